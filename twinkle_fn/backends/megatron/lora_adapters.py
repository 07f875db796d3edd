"""Building the adapters on a placed megatron model (`add_adapters`): each rank's ``GPTModel``
stage gets a `LoraParallelLinear` on every linear its `LoraPlan` selects and an `ExpertLora` on
selected routed experts, seeded per layer and linear, and every other parameter is frozen."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from megatron.core import parallel_state
from peft import LoraConfig
from torch import Tensor

from twinkle_fn.backends.megatron.grouped_experts import GroupedSequentialMLP, grouped_supported
from twinkle_fn.backends.megatron.lora_linear import ExpertLora, LoraParallelLinear
from twinkle_fn.backends.megatron.lora_targets import (
    EXPERT_LINEARS,
    GDN_LINEARS,
    LINEARS,
    MLA_LINEARS,
    SHARED,
    LoraPlan,
    layer_linears,
    resolve,
)


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
