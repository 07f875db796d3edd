"""A megatron model's trained adapter as a peft adapter: the factors gathered from every rank and
split into the HF modules' tensors (`adapter_state_dict`), written as a peft adapter directory
(`save_adapter`)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from peft import LoraConfig
from torch import Tensor

from twinkle_fn import lora as base_lora
from twinkle_fn.backends.megatron.bridge import join_shards
from twinkle_fn.backends.megatron.lora_targets import (
    LoraPlan,
    hf_modules,
    layer_linears,
)
from twinkle_fn.lora import PEFT_PREFIX
from twinkle_fn.state import TrainState

# Where a routed expert's factors live in a parameter name (``...mlp.experts.lora_fc1.lora_A``).
_EXPERT_FACTOR = "mlp.experts.lora_"


def adapter_config(state: TrainState) -> LoraConfig:
    """The resolved ``LoraConfig`` of the state's adapter. Raises ``ValueError`` for a state
    without a megatron LoRA adapter."""
    return _placement(state).lora.config


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
            modules = hf_modules(rule, layer)
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
