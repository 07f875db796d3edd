"""Which linears of a megatron model take LoRA adapters (`resolve`): peft's target selection on
the HF model, mapped to megatron's (fused) parallel linears through the bridge's rules. See
`twinkle_fn.backends.megatron.lora` for the table of linears and what is refused."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists

from twinkle_fn import lora as base_lora
from twinkle_fn.backends.megatron.bridge import MLP, O_PROJ, QKV, Rule, moe_layers
from twinkle_fn.backends.megatron.bridge_rules import (
    attention_rules,
    linear_layers,
    megatron_family,
    moe_rules,
)
from twinkle_fn.lora import ALL_LINEAR, EXPERT_TENSORS, resolve_moe_targets

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


def hf_modules(rule: Rule, layer: int) -> tuple[str, ...]:
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
        for name in hf_modules(rule, layer)
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
            names = hf_modules(rule, layer)
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
