"""Per-family parallelism plans, as data.

A tensor-parallel plan maps a submodule of a decoder layer to ``"colwise"`` (output features split
over tp) or ``"rowwise"`` (input features split; the output is summed across tp). `param_specs`
turns a plan and a mesh into each parameter's sharding: a tuple of `ShardSpec`s applied in order
(tp first, then FSDP's dim-0 split of the tp-local tensor over ``fsdp``). The FSDP backend shards
with the same table, so `local_specs` predicts exactly what each rank holds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch
from transformers import PretrainedConfig

from twinkle_fn.mesh import Mesh
from twinkle_fn.models.families import family_of
from twinkle_fn.sharding import ShardSpec, local_shard

COLWISE, ROWWISE = "colwise", "rowwise"

_ATTENTION = {
    "self_attn.q_proj": COLWISE,
    "self_attn.k_proj": COLWISE,
    "self_attn.v_proj": COLWISE,
    "self_attn.o_proj": ROWWISE,
}
_MLP = {"mlp.gate_proj": COLWISE, "mlp.up_proj": COLWISE, "mlp.down_proj": ROWWISE}

# MoE experts stay whole under tp (their inputs are identical on every tp rank); expert
# parallelism belongs to the Megatron backend.
TP_PLANS: dict[str, dict[str, str]] = {
    "llama": {**_ATTENTION, **_MLP},
    "mistral": {**_ATTENTION, **_MLP},
    "qwen2": {**_ATTENTION, **_MLP},
    "qwen3": {**_ATTENTION, **_MLP},
    "qwen3_moe": dict(_ATTENTION),
}

_LAYER = re.compile(r"^(?:.*\.)?layers\.\d+\.(?P<sub>.+)\.(?P<leaf>weight|bias)$")

Specs = tuple[ShardSpec, ...]


def tp_plan(config: PretrainedConfig, tp: int) -> dict[str, str]:
    """The tensor-parallel plan of `config`'s family, after checking `tp` divides what it splits.

    Raises ``ValueError`` naming the size that `tp` does not divide.
    """
    plan = TP_PLANS[family_of(config)]
    sizes = {
        "attention heads": config.num_attention_heads,
        "key/value heads": getattr(config, "num_key_value_heads", config.num_attention_heads),
    }
    if "mlp.up_proj" in plan:
        sizes["MLP intermediate features"] = config.intermediate_size
    for what, n in sizes.items():
        if n % tp:
            raise ValueError(
                f"tp={tp} does not divide the {n} {what} of this model; use a tp that divides {n}"
            )
    return plan


def param_specs(names: Iterable[str], config: PretrainedConfig, mesh: Mesh) -> dict[str, Specs]:
    """Each parameter's sharding on `mesh`: its tp split (from the plan), then fsdp's dim-0 split.

    Parameters outside the plan (embeddings, norms, the lm_head, MoE experts) are replicated over
    tp. Every parameter is split over ``fsdp`` on dim 0 of its tp-local tensor, as FSDP2 does.
    """
    plan = tp_plan(config, mesh.tp)
    specs = {}
    for name in names:
        tp_spec = _tp_spec(plan, name)
        specs[name] = (tp_spec, ShardSpec(0, "fsdp")) if tp_spec else (ShardSpec(0, "fsdp"),)
    return specs


def local_specs(tensor: torch.Tensor, specs: Specs, coords: Mapping[str, int], mesh: Mesh):
    """The part of `tensor` that the rank at `coords` holds under `specs`, applied in order."""
    for spec in specs:
        tensor = local_shard(tensor, spec, coords, mesh)
    return tensor


def _tp_spec(plan: Mapping[str, str], name: str) -> ShardSpec | None:
    match = _LAYER.match(name)
    if match is None or match["sub"] not in plan:
        return None
    style, leaf = plan[match["sub"]], match["leaf"]
    if style == COLWISE:
        return ShardSpec(0, "tp")
    return ShardSpec(1, "tp") if leaf == "weight" else None
