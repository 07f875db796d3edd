"""The model option ``fp8`` on the megatron backend: decoder linears with float8 GEMMs.

`use_fp8_linears` gives each trained ``ColumnParallelLinear`` / ``RowParallelLinear`` of the
decoder layers (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``, a shared
expert's; not the embedding, the output layer, the router or the routed experts, which run as
grouped GEMMs) a matmul of `twinkle_fn.backends.fp8.fp8_linear` (recipes, numerics and
requirements there). Megatron's linear calls its ``_forward_impl`` with the input on this rank,
the weight shard and its tensor-parallel duties; the replacement keeps the duties with
megatron's own differentiable collectives (under sequence parallelism a column-parallel input is
all-gathered over the sequence, its gradient reduce-scattered; without, the input gradient is
all-reduced over tp) and multiplies the local shards in float8. A row-parallel output is reduced
by the linear itself afterwards, as before. The weight gradient leaves through autograd into
megatron's DDP hook, which adds it to the float32 ``main_grad`` (``gradient_accumulation_fusion``,
which would write it there inside the GEMM, is refused with fp8).

Under LoRA those linears are the frozen bases: their forward and input-gradient GEMMs, most of a
LoRA step's work, run in float8 (no weight gradient), while the adapters' factors, too small
for float8 GEMMs to pay, keep megatron's matmul. TransformerEngine's layers
(``use_te``) have their own float8 recipes (``TransformerConfig.fp8``), not wired here: the
option refuses them.

``fp8_store_frozen=True`` (with ``fp8``; `store_frozen`) stores each converted linear's frozen
weight (a LoRA base; on each rank its tp shard) in float8, as on the transformers backend
(`twinkle_fn.backends.fp8.store_weight`: e4m3 and one power-of-two scale, the non-persistent
buffer ``fp8_weight_scale``): one byte an element instead of two, never quantised again, the
tensorwise recipe's numbers bit for bit. A merged export reads it dequantised (`dense_weight`);
checkpoints of a LoRA model hold only the adapters.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from torch import Tensor

from twinkle_fn.backends.fp8 import (
    E4M3,
    check_device,
    check_linear,
    check_setting,
    check_store_setting,
    dequantise,
    fp8_linear,
    store_weight,
)


def use_fp8_linears(gpt: torch.nn.Module, setting: object) -> int:
    """Apply the option ``fp8`` (its value `setting`) to the decoder layers of the ``GPTModel``
    stage `gpt` (after LoRA adapters are added, before compilation); returns how many linears
    now multiply in float8 (0 with the option off).

    Raises ``ValueError`` for an unknown recipe, a device without float8 GEMMs, TransformerEngine
    layers, ``gradient_accumulation_fusion``, a linear whose weight shard is not a multiple of 16
    in both dimensions (naming it).
    """
    recipe = check_setting(setting)
    if recipe is None:
        return 0
    check_device(next(gpt.parameters()).device)
    converted = 0
    for i, layer in enumerate(gpt.decoder.layers):
        for name, module in layer.named_modules():
            if type(module).__module__.startswith("megatron.core.extensions.transformer_engine"):
                raise ValueError(
                    f"option fp8={recipe!r}: decoder.layers.{i}.{name} is TransformerEngine's "
                    f"{type(module).__name__}, whose float8 recipes are TransformerConfig.fp8's; "
                    "build with option use_te=False for this fp8, or drop it"
                )
            if not _converts(name, module):
                continue
            tp = module.tp_group.size() if module.tp_group is not None else 1
            check_linear(
                f"decoder.layers.{i}.{name}",
                *module.weight.shape,
                f" (this rank's shard at tp={tp})" if tp > 1 else "",
            )
            if module.gradient_accumulation_fusion:
                raise ValueError(
                    f"option fp8 with gradient_accumulation_fusion=True: decoder.layers.{i}."
                    f"{name}'s weight gradient would skip the float8 GEMM; set it False"
                )
            module._forward_impl = functools.partial(_fp8_forward_impl, recipe)
            converted += 1
    return converted


def store_frozen(gpt: torch.nn.Module, options: dict[str, Any]) -> int:
    """Apply the option ``fp8_store_frozen`` (see the module docstring) to the ``GPTModel``
    stage `gpt` after `use_fp8_linears`, and after ``Float16Module`` wraps it (whose cast of
    every floating tensor would read the float8 bytes as numbers); returns how many weights are
    stored in float8. Raises ``ValueError`` for a value other than a bool, or True without
    ``fp8``."""
    if not check_store_setting(options):
        return 0
    recipe = check_setting(options.get("fp8"))
    stored = 0
    for module in gpt.decoder.modules():
        if "_forward_impl" not in module.__dict__ or module.weight.requires_grad:
            continue
        wq, scale = store_weight(module.weight.detach())
        module.weight = torch.nn.Parameter(wq, requires_grad=False)
        module.register_buffer("fp8_weight_scale", scale, persistent=False)
        module._forward_impl = functools.partial(_fp8_forward_impl, recipe, w_scale=scale)
        stored += 1
    return stored


def dense_weight(linear: torch.nn.Module) -> Tensor:
    """`linear`'s weight (this rank's shard), dequantised to float32 (exactly) when it is
    stored in float8 (`store_frozen`)."""
    w = linear.weight.detach()
    return dequantise(w, linear.fp8_weight_scale) if w.dtype == E4M3 else w


def _converts(name: str, module: torch.nn.Module) -> bool:
    """Whether the decoder-layer submodule `name` takes float8 GEMMs: a column- or row-parallel
    linear (trained, or a frozen LoRA base) that is not a routed expert's nor a LoRA factor."""
    return (
        isinstance(module, (ColumnParallelLinear, RowParallelLinear))
        and not module.is_expert
        and module.weight is not None
        and not any(part.startswith("lora_") for part in name.split("."))
    )


def _fp8_forward_impl(
    recipe: str,
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    tp_group: torch.distributed.ProcessGroup | None = None,
    w_scale: Tensor | None = None,
    **_unused: Any,
) -> Tensor:
    """Megatron's ``_forward_impl`` (`input` ``[seq, batch, in]``, this rank's sequence chunk
    under `sequence_parallel`; `weight` ``[out, in]`` this rank's shard, float8 with its scale
    `w_scale` when stored so) in float8: the input gathered and its gradient reduced as
    megatron's fused linear does, then `fp8_linear` (with no weight gradient for a frozen
    `weight`)."""
    if sequence_parallel:
        input = gather_from_sequence_parallel_region(
            input, tensor_parallel_output_grad=True, group=tp_group
        )
    elif allreduce_dgrad:
        input = copy_to_tensor_model_parallel_region(input, group=tp_group)
    return fp8_linear(input, weight, bias, recipe, w_scale)
