"""Parallelism plans, as data.

A model's tensor-parallel plan is its family's (`twinkle_fn.models.families.Family.tp_plan`,
checked against the model's sizes by `tp_plan`): it maps a submodule of a decoder layer to
``"colwise"`` (output features split over tp) or ``"rowwise"`` (input features split; the
output is summed across tp). `param_specs` turns a plan and a mesh into each parameter's
sharding: a tuple of `ShardSpec`s applied in order (tp first, then FSDP's dim-0 split of the
tp-local tensor over ``fsdp``). The FSDP backend shards with the same table, so `local_specs`
predicts exactly what each rank holds.

A linear layer that peft wrapped with LoRA (``y = base_layer(x) + lora_B(lora_A(x))``) keeps its
plan entry: `with_lora` moves it onto ``base_layer`` and splits the adapter factor that sits on
the split side (``lora_B`` like a colwise base's outputs, ``lora_A`` like a rowwise base's
inputs); the other factor is small and stays whole on every tp rank.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch
from transformers import PretrainedConfig

from twinkle_fn.backends.transformers.expert_parallel import expert_spec
from twinkle_fn.mesh import Mesh
from twinkle_fn.models.families import COLWISE, family
from twinkle_fn.sharding import ShardSpec, local_shard

# Sequence parallelism (with tp): norms run on this rank's slice of the sequence, and the
# sequence is gathered into the attention and the MLP and scattered back by their rowwise
# outputs. Styles: "norm" (a norm over the local sequence shard), "gather" (the module's
# hidden-states input: sequence shards -> whole), "scatter" (the module's output: whole -> shard).
SEQUENCE_PARALLEL_LAYER: dict[str, str] = {
    "input_layernorm": "norm",
    "self_attn": "gather",
    "post_attention_layernorm": "norm",
    "mlp": "gather",
}
SEQUENCE_PARALLEL_ROOT: dict[str, str] = {
    "model.embed_tokens": "scatter",
    "model.norm": "norm",
    "lm_head": "gather",
}

_LAYER = re.compile(r"^(?:.*\.)?layers\.\d+\.(?P<sub>.+)\.(?P<leaf>weight|bias)$")
# peft LoRA submodules of a wrapped linear: its base, or an adapter factor under some name.
_LORA = re.compile(r"^(?P<sub>.+)\.(?:base_layer|(?P<factor>lora_A|lora_B)\.[^.]+)$")

Specs = tuple[ShardSpec, ...]


def tp_plan(config: PretrainedConfig, tp: int) -> dict[str, str]:
    """The tensor-parallel plan of `config`'s family, after checking `tp` divides what it splits.

    MoE experts stay whole under tp (their inputs are identical on every tp rank); they split
    over ``ep`` instead (`twinkle_fn.backends.transformers.expert_parallel`). Raises
    ``ValueError`` naming the size that `tp` does not divide, for a family the backend does not
    split (`Family.tensor_parallel`), or for an unknown family.
    """
    row = family(config)
    if tp > 1 and row.tensor_parallel is not None:
        raise ValueError(
            f"tp={tp} is not supported for model family {row.name!r} on the transformers "
            f"backend: {row.tensor_parallel}. Use tp=1 (fsdp or dp for more ranks)."
        )
    plan = dict(row.tp_plan)
    sizes = {
        "attention heads": config.num_attention_heads,
        "key/value heads": getattr(config, "num_key_value_heads", config.num_attention_heads),
    }
    if "mlp.up_proj" in plan:
        sizes["MLP intermediate features"] = config.intermediate_size
    shared = row.moe.shared if row.moe is not None else None
    if shared is not None and any(sub.startswith(f"{shared.mlp}.") for sub in plan):
        sizes["shared expert intermediate features"] = shared.size(config)
    for what, n in sizes.items():
        if n % tp:
            raise ValueError(
                f"tp={tp} does not divide the {n} {what} of this model; use a tp that divides {n}"
            )
    return plan


def with_lora(plan: Mapping[str, str], module_names: Iterable[str]) -> dict[str, str]:
    """`plan` for a decoder layer whose submodules are `module_names`, peft LoRA layers included.

    An entry whose module peft wrapped (it has a ``.base_layer``) moves to the base layer, and
    the factors ``<sub>.lora_B.<adapter>`` (colwise) or ``<sub>.lora_A.<adapter>`` (rowwise)
    get the same style; other entries are unchanged.
    """
    names = set(module_names)
    out = {}
    for sub, style in plan.items():
        if f"{sub}.base_layer" not in names:
            out[sub] = style
            continue
        out[f"{sub}.base_layer"] = style
        factor = f"{sub}.{'lora_B' if style == COLWISE else 'lora_A'}."
        out.update(
            {n: style for n in names if n.startswith(factor) and "." not in n[len(factor) :]}
        )
    return out


def param_specs(names: Iterable[str], config: PretrainedConfig, mesh: Mesh) -> dict[str, Specs]:
    """Each parameter's sharding on `mesh`: its tp split (from the plan), then the data split.

    Parameters outside the plan (embeddings, norms, the lm_head, MoE experts) are replicated over
    tp. Every parameter is split on dim 0 of its tp-local tensor, as FSDP2 does, over ``fsdp``,
    or over ``dp`` when that is the only data axis (`twinkle_fn.backends.transformers.fsdp`'s ZeRO-2).
    Under ``ep`` the MoE expert tensors split over ``ep`` then ``edp`` instead
    (`twinkle_fn.backends.transformers.expert_parallel.expert_spec`).
    """
    plan = tp_plan(config, mesh.tp)
    data = ShardSpec(0, data_axis(mesh))
    specs = {}
    for name in names:
        if mesh.ep > 1 and (experts := expert_spec(name, config)) is not None:
            specs[name] = experts
            continue
        tp_spec = _tp_spec(plan, name)
        specs[name] = (tp_spec, data) if tp_spec else (data,)
    return specs


def data_axis(mesh: Mesh) -> str:
    """The mesh axis FSDP2 splits parameters over: ``fsdp``, or ``dp`` when it is the only data
    axis (ZeRO-2); with both, ``fsdp`` (HSDP replicates the shards over ``dp``)."""
    return "dp" if mesh.fsdp == 1 and mesh.dp > 1 else "fsdp"


def local_specs(tensor: torch.Tensor, specs: Specs, coords: Mapping[str, int], mesh: Mesh):
    """The part of `tensor` that the rank at `coords` holds under `specs`, applied in order."""
    for spec in specs:
        tensor = local_shard(tensor, spec, coords, mesh)
    return tensor


def _tp_spec(plan: Mapping[str, str], name: str) -> ShardSpec | None:
    match = _LAYER.match(name)
    if match is None:
        return None
    sub, factor = match["sub"], None
    if lora := _LORA.match(sub):
        sub, factor = lora["sub"], lora["factor"]
    if sub not in plan:
        return None
    style, leaf = plan[sub], match["leaf"]
    if factor == ("lora_A" if style == COLWISE else "lora_B"):
        return None  # the adapter factor on the unsplit side stays whole
    if style == COLWISE:
        return ShardSpec(0, "tp")
    return ShardSpec(1, "tp") if leaf == "weight" else None
