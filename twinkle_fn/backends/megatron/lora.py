"""LoRA on megatron-core's parallel linears (the megatron backend), exported as a peft adapter.

`add_lora` puts a ``peft.LoraConfig`` into a megatron model's ``options["lora"]``; when the
backend places the model (``tf.init``), `add_adapters` wraps the selected linears of each rank's
``GPTModel`` stage in `LoraParallelLinear` and freezes every other parameter, after the base
weights are loaded and before megatron's DDP and optimizer are built: the DDP grad buffers, the
train state and the distributed optimizer hold the adapters only.

Targets are named as on the HF model (peft's ``target_modules``, ``exclude_modules``,
``layers_to_transform``; ``"all-linear"`` = every linear below, never the lm_head):

=============================  ===============================  ==============================
megatron linear                HF modules                        parallel layout
=============================  ===============================  ==============================
self_attention.linear_qkv      q_proj, k_proj, v_proj (fused)   column: B split like the base
self_attention.linear_proj     o_proj                           row: A split like the base
mlp.linear_fc1                 gate_proj, up_proj (fused)       column
mlp.linear_fc2                 down_proj                        row
mlp.shared_experts.linear_fc1  shared expert's gate/up (fused)  column
mlp.shared_experts.linear_fc2  shared expert's down_proj        row
mlp.experts (fc1, fc2)         experts.gate_up_proj, down_proj  whole per expert (etp 1), over ep
=============================  ===============================  ==============================

Multi-latent attention (`twinkle_fn.backends.megatron.mla`) takes adapters on every linear of
`MLA_LINEARS` instead of ``linear_qkv``: ``q_a_proj``, ``q_b_proj`` (or ``q_proj``),
``kv_a_proj_with_mqa``, ``kv_b_proj``, all column-parallel (the down projections' rows split
like their base weights; their outputs are gathered), and ``o_proj`` as above.

Routed experts are targeted as peft 0.17+ targets transformers 5's fused experts,
``target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]`` (``"all-linear"``
includes both, see `twinkle_fn.lora.resolve_moe_targets`): one adapter per expert and linear
(`ExpertLora`, added by `GroupedSequentialMLP`'s grouped GEMMs), exported in peft's
``ParamWrapper`` layout (``lora_A`` ``[r * experts, in]`` expert-major, ``lora_B``
``[out, r * experts]`` rank-major), gathered over the expert-parallel ranks.

A fused linear gets one adapter: one ``A`` shared by its parts and one ``B`` laid out like the
base weight (q/k/v rows interleaved per query group, ``[gate; up]`` per tp rank). A config that
selects only some parts of a fused linear (``q_proj`` without ``k_proj``) is refused: the update
of the unselected parts would have to be pinned at zero. The exported adapter gives each part
its rows of ``B`` and a copy of ``A``, which is the same update, so peft applies it exactly.

The HF / megatron naming and the fused layouts come from the bridge's rules and transforms
(`twinkle_fn.backends.megatron.bridge`); parameter names are megatron's with ``base_layer``, ``lora_A``,
``lora_B`` inserted (``decoder.layers.0.self_attention.linear_qkv.lora_A.weight``).

Not supported (refused with an error naming the field): routers and shared-expert gates, expert
LoRA under expert tensor parallelism (etp > 1) or on experts that run megatron's loop, DoRA,
trained biases, ``modules_to_save``, per-module ``rank_pattern`` / ``alpha_pattern``,
initialisations that rewrite the base weights. ``"all-linear"`` on a model whose first dense
MLPs share their linears' names with its experts (GLM-4 MoE) leaves those MLPs out (see
`resolve`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists
from torch import Tensor

from twinkle_fn import lora as base_lora
from twinkle_fn.backends.megatron.bridge import MLP, O_PROJ, QKV, Rule, join_shards, moe_layers
from twinkle_fn.backends.megatron.bridge_rules import (
    attention_rules,
    linear_layers,
    megatron_family,
    moe_rules,
)
from twinkle_fn.backends.megatron.grouped_experts import GroupedSequentialMLP, grouped_supported
from twinkle_fn.backends.megatron.lora_linear import ExpertLora, LoraParallelLinear
from twinkle_fn.lora import ALL_LINEAR, EXPERT_TENSORS, PEFT_PREFIX, resolve_moe_targets
from twinkle_fn.models.model import Model
from twinkle_fn.state import TrainState

# The linears that take adapters, in export order, with the bridge rule of their weight.
LINEARS: dict[str, Rule] = {
    "self_attention.linear_qkv": QKV,
    "self_attention.linear_proj": O_PROJ,
    "mlp.linear_fc1": MLP[0],
    "mlp.linear_fc2": MLP[1],
}
# A Gated DeltaNet layer's linears take the slots of the attention's (seeds, export order).
GDN_LINEARS = ("self_attention.in_proj", "self_attention.out_proj")
# Multi-latent attention's linears, which replace linear_qkv, in seed-slot order.
MLA_LINEARS = (
    "self_attention.linear_q_proj",
    "self_attention.linear_q_down_proj",
    "self_attention.linear_q_up_proj",
    "self_attention.linear_kv_down_proj",
    "self_attention.linear_kv_up_proj",
)
# An MoE layer's shared-expert linears take the slots of the dense MLP's (seeds, export order).
SHARED = {"mlp.shared_experts.linear_fc1": 2, "mlp.shared_experts.linear_fc2": 3}
# The routed experts' linears, in the order of `EXPERT_TENSORS`.
EXPERT_LINEARS = ("linear_fc1", "linear_fc2")
# Where a routed expert's factors live in a parameter name (``...mlp.experts.lora_fc1.lora_A``).
_EXPERT_FACTOR = "mlp.experts.lora_"
# LoraConfig fields refused unless at their off value: why, and the off value.
_UNSUPPORTED: dict[str, tuple[str, Any]] = {
    "bias": ("trains the base layers' biases", "none"),
    "lora_bias": ("trains a bias on lora_B", False),
    "modules_to_save": ("trains whole copies of modules", None),
    "trainable_token_indices": ("trains rows of the embedding", None),
    "use_dora": ("(DoRA) trains a magnitude vector", False),
    "rank_pattern": ("gives layers their own rank", {}),
    "alpha_pattern": ("gives layers their own alpha", {}),
    "layer_replication": ("duplicates layers", None),
}


@dataclasses.dataclass(frozen=True)
class LoraPlan:
    """Which linears of the model carry adapters.

    ``config``: a private copy of the ``LoraConfig`` (``"all-linear"`` resolved to the HF leaf
    names and expert tensors it covers, as peft records it); ``layers``: per global layer
    index, the adapted megatron linears (keys of `LINEARS` or `SHARED`, in that order);
    ``experts``: per global MoE layer, the adapted routed-expert linears (of
    `EXPERT_LINEARS`); ``expert_keys``: per (layer, expert linear), the module path of its
    adapter in peft's file (``model.layers.0.mlp.experts.base_layer``). Layers without
    adapters are absent.
    """

    config: LoraConfig
    layers: Mapping[int, tuple[str, ...]]
    experts: Mapping[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    expert_keys: Mapping[tuple[int, str], str] = dataclasses.field(default_factory=dict)


def lora_config(config: LoraConfig | Mapping[str, Any]) -> LoraConfig:
    """A private copy of `config`, checked to train low-rank adapters only.

    Raises ``TypeError`` for something that is neither a ``LoraConfig`` nor a mapping of its
    fields, and ``ValueError`` for a field this backend does not support (naming its off
    value) or ``target_modules=None`` (peft's per-family default adapts q and v only, which
    would split megatron's fused qkv).
    """
    config = base_lora.lora_config(config)
    base_lora.check_adapters_only(config, _UNSUPPORTED, "the megatron backend's LoRA")
    if config.target_modules is None:
        raise ValueError(
            "LoraConfig.target_modules is None (peft's per-family default); name the HF "
            "modules to adapt, e.g. target_modules='all-linear' or ['q_proj', 'k_proj', "
            "'v_proj', 'o_proj']"
        )
    return config


def _hf_modules(rule: Rule, layer: int) -> tuple[str, ...]:
    """The HF module names of `rule`'s tensors in global layer `layer`."""
    return tuple(name.format(layer=layer).removesuffix(".weight") for name in rule.hf)


def layer_linears(hf_config: Any) -> list[dict[str, Rule]]:
    """Per global layer, the linears that take a `LoraParallelLinear` and their bridge rules
    (MoE layers: attention and the shared expert's MLP, if any; a Gated DeltaNet layer's
    ``in_proj`` and ``out_proj`` in the attention's slots, `GDN_LINEARS`; multi-latent
    attention's linears of `MLA_LINEARS` in place of ``linear_qkv``)."""
    fam = megatron_family(hf_config)
    moe = fam.moe
    by_name = (
        {r.mcore.removeprefix("decoder.layers.{layer}."): r for r in moe_rules(moe)} if moe else {}
    )
    shared = {k: by_name[f"{k}.weight"] for k in SHARED if f"{k}.weight" in by_name}
    mixers = {
        r.mcore.removeprefix("decoder.layers.{layer}."): r for r in attention_rules(hf_config)
    }
    names = [k for k in LINEARS if k.startswith("self_attention.")]
    if fam.latent_attention:
        names = [*MLA_LINEARS, *names[1:]]
    attention = {k: mixers[f"{k}.weight"] for k in names if f"{k}.weight" in mixers}
    linear = {k: mixers[f"{k}.weight"] for k in GDN_LINEARS if f"{k}.weight" in mixers}
    mlp = {k: r for k, r in LINEARS.items() if k.startswith("mlp.")}
    return [
        {**(linear if la else attention), **(shared if m else mlp)}
        for m, la in zip(moe_layers(hf_config), linear_layers(hf_config), strict=True)
    ]


def _expert_plan(
    config: LoraConfig, hf_module: torch.nn.Module
) -> tuple[dict[int, tuple[str, ...]], dict[tuple[int, str], str]]:
    """The routed-expert linears `config.target_parameters` selects per layer, and each one's
    module path in peft's file: peft nests one ``ParamWrapper`` per targeted tensor of a module
    in the module's parameter order, the first innermost (``...experts.base_layer``)."""
    experts: dict[int, tuple[str, ...]] = {}
    keys: dict[tuple[int, str], str] = {}
    targets = config.target_parameters or ()
    for name, module in hf_module.named_modules():
        owned = [p for p, _ in module.named_parameters(recurse=False)]
        picked = [
            p
            for p in owned
            if p in EXPERT_TENSORS
            and any(f"{name}.{p}" == t or f"{name}.{p}".endswith(f".{t}") for t in targets)
        ]
        if not picked:
            continue
        layer = int(name.split(".layers.", 1)[1].split(".", 1)[0])
        parts = [EXPERT_LINEARS[EXPERT_TENSORS.index(p)] for p in picked]
        experts[layer] = tuple(sorted(parts))
        for depth, part in enumerate(parts):
            keys[layer, part] = name + ".base_layer" * (len(parts) - 1 - depth)
    return experts, keys


def _selected(config: LoraConfig, hf_module: torch.nn.Module) -> set[str]:
    """The names of `hf_module`'s modules that peft's matcher selects under `config`."""
    return {n for n, _ in hf_module.named_modules() if n and check_target_module_exists(config, n)}


def resolve(config: LoraConfig | Mapping[str, Any], hf_module: torch.nn.Module) -> LoraPlan:
    """The adapters `config` asks for on the HF model `hf_module` (may be on the meta device).

    Every module of `hf_module` that peft's matcher selects must be one of the linears of
    `LINEARS` (or `SHARED`), and a fused linear's parts are selected all or none; routed experts
    come from ``target_parameters`` (`twinkle_fn.lora.resolve_moe_targets`). Raises
    ``ValueError`` for what `lora_config` and `resolve_moe_targets` refuse, targets that match
    nothing (naming the supported modules), a selected module that is not one of those
    linears (the lm_head, an embedding, a router...), or part of a fused linear (naming the
    missing parts).
    """
    config = resolve_moe_targets(lora_config(config), hf_module)
    hf_config = hf_module.config
    per_layer = layer_linears(hf_config)
    supported = {
        name
        for layer, rules in enumerate(per_layer)
        for rule in rules.values()
        for name in _hf_modules(rule, layer)
    }
    if isinstance(config.target_modules, str) and config.target_modules.lower() == ALL_LINEAR:
        config.target_modules = {name.rsplit(".", 1)[1] for name in supported}
        if _selected(config, hf_module) - supported:
            # The dense MLPs' names are also the shared and routed experts' (GLM-4 MoE and
            # DeepSeek-V3 begin with dense layers), which this LoRA cannot adapt; and peft
            # rewrites any gate/up/down_proj target of such an MoE model to its fused
            # experts, so an adapter on those MLPs would not load as trained: attention only.
            config.target_modules = {
                name.rsplit(".", 1)[1] for name in supported if ".mlp." not in name
            }
    selected = _selected(config, hf_module)
    others = sorted(selected - supported)
    if others:
        raise ValueError(
            f"target_modules={config.target_modules!r} selects {others[:3]}, which the megatron "
            "backend's LoRA cannot adapt: it adapts the attention, dense-MLP and shared-expert "
            "linears (q/k/v/o_proj, gate/up/down_proj) and routed experts through "
            "target_parameters; leave the others out"
        )
    experts, expert_keys = _expert_plan(config, hf_module)
    if not selected and not experts:
        raise ValueError(
            f"target_modules={config.target_modules!r} matches no linear layer of this model; "
            f"adaptable: {sorted({n.rsplit('.', 1)[1] for n in supported})} or 'all-linear'"
        )
    layers: dict[int, tuple[str, ...]] = {}
    for layer, rules in enumerate(per_layer):
        chosen = []
        for key, rule in rules.items():
            names = _hf_modules(rule, layer)
            missing = [n.rsplit(".", 1)[1] for n in names if n not in selected]
            if len(missing) == len(names):
                continue
            if missing:
                raise ValueError(
                    f"target_modules={config.target_modules!r} selects part of "
                    f"{[n.rsplit('.', 1)[1] for n in names]} in layer {layer}, which megatron "
                    f"fuses into one {key.rsplit('.', 1)[1]} with one adapter; add {missing} "
                    "(or use 'all-linear')"
                )
            chosen.append(key)
        if chosen:
            layers[layer] = tuple(chosen)
    return LoraPlan(config, layers, experts, expert_keys)


def add_lora(
    model: Model, config: LoraConfig | Mapping[str, Any], adapter_name: str = "default"
) -> Model:
    """`model` (megatron backend, not yet placed) set to train LoRA adapter `adapter_name` of
    `config` only.

    Checks `config` against the model (see `resolve`) and returns a copy of `model` whose
    ``options["lora"]`` is a private copy of it (and ``options["lora_name"]`` the name);
    ``tf.init`` then builds the adapters (see `add_adapters`). Building the model with
    ``options={"lora": config}`` is the same, checked at ``tf.init``. Raises ``ValueError`` for
    a model of another backend, one already placed or with a LoRA config (one adapter per
    model), an empty name or one holding a ``.``, and as `resolve` does.
    """
    if model.backend != "megatron":
        raise ValueError(
            f"this model runs on the {model.backend!r} backend; use twinkle_fn.lora.add_lora"
        )
    if model.placement is not None:
        raise ValueError(
            "this model is already placed; add adapters before tf.init (add_lora on the model, "
            "then tf.init(model, tx, mesh))"
        )
    if not isinstance(adapter_name, str) or not adapter_name or "." in adapter_name:
        raise ValueError(f"adapter_name must be a non-empty str without '.', got {adapter_name!r}")
    if model.options.get("lora") is not None:
        raise ValueError(
            f"this model already has a LoRA config (adapter {adapter_names(model)}); the "
            "megatron backend trains one adapter per model: build another model for another one"
        )
    resolve(config, model.module)
    options = {**model.options, "lora": lora_config(config), "lora_name": adapter_name}
    return dataclasses.replace(model, options=options)


def adapter_names(model: Model) -> list[str]:
    """The model's one adapter name (``options["lora_name"]``, default ``"default"``), or
    none."""
    if model.options.get("lora") is None:
        return []
    return [model.options.get("lora_name", "default")]


def adapter_config(state: TrainState) -> LoraConfig:
    """The resolved ``LoraConfig`` of the state's adapter. Raises ``ValueError`` for a state
    without a megatron LoRA adapter."""
    return _placement(state).lora.config


def add_adapters(
    gpt: torch.nn.Module, config: LoraConfig | Mapping[str, Any], hf_module: torch.nn.Module
) -> LoraPlan:
    """Wrap the linears `config` selects in this rank's ``GPTModel`` stage; freeze the rest.

    Call it after the base weights are loaded and before megatron's DDP and optimizer are
    built. Every parameter but the adapters' gets ``requires_grad=False``. The adapter of
    global layer ``l``'s ``k``-th linear of `LINEARS` is seeded with ``4 * l + k`` (a shared
    expert's linears take the dense MLP's ``k``), the routed experts' linear ``j`` of
    `EXPERT_LINEARS` with ``4 * layers + 2 * l + j`` (see `ExpertLora`), multi-latent
    attention's ``m``-th linear of `MLA_LINEARS` with ``6 * layers + 5 * l + m`` (a Gated
    DeltaNet layer's `GDN_LINEARS` take the attention's ``k``). Under
    activation recomputation the embedding's output is made to require grad, so that
    megatron's checkpointed layers (which see no trainable input otherwise) backpropagate.
    Returns the plan (`resolve` of `config` on the HF model `hf_module`). Raises
    ``ValueError`` as `resolve` does, when a pipeline stage would hold no adapter, and for
    expert targets under etp > 1 or on experts that run megatron's loop.
    """
    plan = resolve(config, hf_module)
    hf_config = hf_module.config
    _check_stages(plan, hf_config.num_hidden_layers)
    rules = layer_linears(hf_config)
    for p in gpt.parameters():
        p.requires_grad_(False)
    for layer in gpt.decoder.layers:
        index = layer.layer_number - 1
        for key in plan.layers.get(index, ()):
            parent, _, attr = key.rpartition(".")
            owner = layer.get_submodule(parent)
            seed = _seed(key, index, hf_config.num_hidden_layers)
            wrapped = LoraParallelLinear(
                getattr(owner, attr), plan.config, rule=rules[index][key], seed=seed
            )
            setattr(owner, attr, wrapped)
        for part in plan.experts.get(index, ()):
            _add_expert_lora(layer.mlp.experts, part, plan.config, index, hf_config)
    if gpt.pre_process and gpt.config.recompute_granularity is not None:
        gpt.embedding.register_forward_hook(_require_grad)
    return plan


def _seed(key: str, index: int, num_layers: int) -> int:
    """The adapter seed of linear `key` of global layer `index` (see `add_adapters`)."""
    if key in MLA_LINEARS:  # after the dense linears' and the routed experts' seeds
        first = (len(LINEARS) + len(EXPERT_LINEARS)) * num_layers
        return first + len(MLA_LINEARS) * index + MLA_LINEARS.index(key)
    if key in GDN_LINEARS:
        slot = GDN_LINEARS.index(key)
    else:
        slot = SHARED[key] if key in SHARED else list(LINEARS).index(key)
    return len(LINEARS) * index + slot


def _add_expert_lora(
    experts: torch.nn.Module, part: str, config: LoraConfig, index: int, hf_config: Any
) -> None:
    """Register an `ExpertLora` on `part` of this rank's routed experts of global layer `index`."""
    if parallel_state.get_expert_tensor_parallel_world_size() > 1:
        raise ValueError(
            "LoRA on routed experts under expert tensor parallelism (etp > 1) is not supported: "
            "use etp=1 (experts whole, split over ep) or leave the experts out "
            "(target_parameters=[])"
        )
    if not isinstance(experts, GroupedSequentialMLP) or not grouped_supported(experts.config):
        raise ValueError(
            f"LoRA on routed experts needs twinkle's grouped experts, but layer {index}'s are "
            f"{type(experts).__name__} with this config (fp8/fp4, expert biases or a fused "
            "activation other than SwiGLU); leave the experts out (target_parameters=[])"
        )
    local = experts.local_experts
    total = hf_config.num_hidden_layers
    lora = ExpertLora(
        [getattr(e, part).weight for e in local],
        config,
        seed=len(LINEARS) * total + 2 * index + EXPERT_LINEARS.index(part),
        first_expert=parallel_state.get_expert_model_parallel_rank() * len(local),
        num_experts=len(local) * parallel_state.get_expert_model_parallel_world_size(),
    )
    experts.add_module(f"lora_{part.removeprefix('linear_')}", lora)


def _require_grad(module: torch.nn.Module, args: Any, output: Tensor) -> None:
    if not output.requires_grad:
        output.requires_grad_(True)


def _check_stages(plan: LoraPlan, num_layers: int) -> None:
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    per_stage = num_layers // pp
    for stage in range(pp):
        adapted = {*plan.layers, *plan.experts}
        if not any(stage * per_stage <= layer < (stage + 1) * per_stage for layer in adapted):
            raise ValueError(
                f"pipeline stage {stage} (layers {stage * per_stage}..{(stage + 1) * per_stage - 1}"
                f") has no adapter under target_modules={plan.config.target_modules!r} and "
                f"layers_to_transform={plan.config.layers_to_transform!r}; every stage needs "
                "one: widen the targets or use a smaller pp"
            )


def _placement(state: TrainState) -> Any:
    # The state's MegatronPlacement (typed loosely: the placement module imports this one).
    state.check_alive()
    placement = state.model.placement
    if getattr(placement, "lora", None) is None:
        raise ValueError(
            "this state has no megatron LoRA adapter; build the model with backend='megatron' "
            "and twinkle_fn.lora.add_lora(model, config) before tf.init"
        )
    return placement


def adapter_state_dict(state: TrainState) -> dict[str, Tensor]:
    """The state's adapter as whole tensors keyed as in a peft adapter file (a collective).

    Keys are ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` etc.; values
    ``[r, in]`` / ``[out, r]`` CPU tensors in the model's parameter dtype, gathered from every
    tp and pp rank on every rank. A fused linear's ``B`` is split into its parts by the
    bridge's transforms, each part getting a copy of the shared ``A``. Routed experts' factors
    are gathered from every ep rank into peft's ``ParamWrapper`` keys and layout
    (``...mlp.experts.base_layer.lora_A.weight`` ``[r * experts, in]``, see
    `_peft_expert_tensors`). Raises ``ValueError`` for a state without a megatron LoRA adapter
    and ``DonatedError`` for a donated state.
    """
    placement = _placement(state)
    mesh, rank = placement.mesh, dist.get_rank()
    coords, expert = mesh.coords(rank), mesh.expert_coords(rank)
    # One rank of each (tp, pp) sends the dense adapters, one of each (ep, pp) the experts'.
    sends = mesh.data_rank(rank) == 0 and coords["cp"] == 0
    sends_experts = expert["edp"] == 0 and expert["etp"] == 0
    local = {
        n: p.detach().cpu()
        for n, p in placement.module.named_parameters()
        if p.requires_grad and (sends_experts if _EXPERT_FACTOR in n else sends)
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, ((coords["tp"], coords["pp"], expert["ep"]), local))
    dense: dict[tuple[int, int], dict[str, Tensor]] = {}
    routed: dict[tuple[int, int], dict[str, Tensor]] = {}
    for (tp, pp, ep), part in gathered:
        for n, t in part.items():
            if _EXPERT_FACTOR in n:
                routed.setdefault((ep, pp), {})[n] = t
            else:
                dense.setdefault((tp, pp), {})[n] = t
    plan, hf_config = placement.lora, placement.hf_config
    return {
        **dict(_peft_tensors(plan, dense, hf_config, mesh.tp, mesh.pp)),
        **dict(_peft_expert_tensors(plan, routed, hf_config, mesh.ep, mesh.pp)),
    }


def _peft_tensors(
    plan: LoraPlan,
    shards: Mapping[tuple[int, int], Mapping[str, Tensor]],
    hf_config: Any,
    tp: int,
    pp: int,
) -> Iterator[tuple[str, Tensor]]:
    per_stage = hf_config.num_hidden_layers // pp
    per_layer = layer_linears(hf_config)
    for layer, keys in sorted(plan.layers.items()):
        stage, local = divmod(layer, per_stage)
        for key in keys:
            rule = per_layer[layer][key]
            prefix = f"decoder.layers.{local}.{key}."
            a, b = (
                [shards[t, stage][prefix + f"lora_{f}.weight"] for t in range(tp)] for f in "AB"
            )
            modules = _hf_modules(rule, layer)
            names_a = [f"{m}.lora_A.weight" for m in modules]
            names_b = [f"{m}.lora_B.weight" for m in modules]
            if rule.tp_dim == 0:  # column: A replicated, B split like the base weight
                pairs = [*((n, a[0]) for n in names_a), *join_shards(rule, names_b, b, hf_config)]
            else:  # row: A split like the base weight, B replicated
                pairs = [*join_shards(rule, names_a, a, hf_config), (names_b[0], b[0])]
            for name, tensor in pairs:
                # Own storage for each: the q/k/v parts are views, A is shared by them.
                yield PEFT_PREFIX + name, tensor.clone()


def _peft_expert_tensors(
    plan: LoraPlan,
    shards: Mapping[tuple[int, int], Mapping[str, Tensor]],
    hf_config: Any,
    ep: int,
    pp: int,
) -> Iterator[tuple[str, Tensor]]:
    """The routed experts' factors in peft's layout (`expert_factors_to_peft`), the ep ranks'
    local experts stacked in global order."""
    per_stage = hf_config.num_hidden_layers // pp
    for layer, parts in sorted(plan.experts.items()):
        stage, local = divmod(layer, per_stage)
        for part in parts:
            prefix = expert_factor_name(local, part) + "."
            a, b = (
                torch.cat([shards[e, stage][prefix + f"lora_{f}"] for e in range(ep)]) for f in "AB"
            )
            yield from expert_factors_to_peft(plan, layer, part, a, b)


def expert_factor_name(layer: int, part: str) -> str:
    """The stage-local parameter path of `ExpertLora` on `part` of local layer `layer`, without
    the factor (``decoder.layers.0.mlp.experts.lora_fc1``)."""
    return f"decoder.layers.{layer}.{_EXPERT_FACTOR}{part.removeprefix('linear_')}"


def expert_factors_to_peft(
    plan: LoraPlan, layer: int, part: str, a: Tensor, b: Tensor
) -> Iterator[tuple[str, Tensor]]:
    """Every expert's factors of `part` of global layer `layer` (`a` ``[E, r, in]``, `b`
    ``[E, out, r]``, experts in global order) under peft's ``ParamWrapper`` keys and layout:
    ``lora_A`` ``[E * r, in]`` (row ``e * r + k``), ``lora_B`` ``[out, r * E]`` (column
    ``k * E + e``)."""
    key = PEFT_PREFIX + plan.expert_keys[layer, part]
    yield f"{key}.lora_A.weight", a.reshape(-1, a.shape[-1]).contiguous()
    yield f"{key}.lora_B.weight", b.permute(1, 2, 0).reshape(b.shape[1], -1).contiguous()


def save_adapter(state: TrainState, path: str | os.PathLike[str]) -> Path:
    """Write the state's adapter as a peft adapter directory at `path`; returns the path.

    The layout of `twinkle_fn.backends.transformers.lora.save_adapter` (``adapter_config.json`` with the resolved
    config, task ``CAUSAL_LM``; ``adapter_model.safetensors``), for
    ``peft.PeftModel.from_pretrained(hf_model, path)``. Every rank must call it (the adapter is
    gathered); rank 0 writes a temporary sibling directory and renames it into place,
    replacing an older one only once the new one is complete. Raises ``ValueError`` for a
    state without a megatron LoRA adapter, and ``RuntimeError`` on every rank when rank 0
    fails to write (its error in the message).
    """
    placement = _placement(state)
    config, hf_config = placement.lora.config, placement.hf_config
    return base_lora.write_adapter(config, hf_config, adapter_state_dict(state), path)
