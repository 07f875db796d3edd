"""`FactorScaledLinear`: peft's LoRA ``Linear`` whose forward scales the ``A`` factor, not the output.

peft adds ``B(A(dropout(x))) * scaling`` to the base layer's output; this layer adds
``B((scaling * A)(dropout(x)))``: the same function, bit for bit when the scale is a power of
two (``lora_alpha / r`` usually is), else up to the rounding of the scaled ``[r, in]`` factor.
What changes is backward. peft's form scales the ``[tokens, out]`` output gradient before B's
two GEMMs read it, a copy written in every adapted linear of every layer; here the scale meets
``A``'s ``[r, in]`` gradient, in the kernel that casts the float32 factor to the compute dtype
anyway (no kernel of its own under ``torch.compile``). (The megatron backend's adapters scale
their rank-r intermediate: there the output-sized copy cost 13 ms of a 4B LoRA step's 290 on
an H200, `benchmarks/RESULTS.md`.) A factor behind module hooks (tensor parallelism's
redistributions) takes peft's path, as its forward must run, and so does a ``B`` with a bias
(``lora_bias``), which peft scales with the update.

Only the plain forward is replaced: disabled or merged adapters, peft's LoRA variants and
extra forward arguments (mixed-batch ``adapter_names``) take peft's own path, and names,
merging and ``get_delta_weight`` are peft's.
"""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners.lora.layer import Linear
from torch.distributed.tensor import DTensor


class FactorScaledLinear(Linear):
    """peft's LoRA ``Linear`` (input ``[..., in]``, output ``[..., out]``) with the scale
    applied to the ``A`` factor."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``base(x) + sum over active adapters of B((scaling * A)(dropout(x)))``; peft's
        forward wherever it does more than that (see the module docstring)."""
        active = [a for a in self.active_adapters if a in self.lora_A]
        plain = not (args or kwargs or self.disable_adapters or self.merged)
        if not plain or any(a in self.lora_variant or _unplain(self, a) for a in active):
            return super().forward(x, *args, **kwargs)
        result = self.base_layer(x)
        dtype = result.dtype
        for name in active:
            lora_a, lora_b = self.lora_A[name], self.lora_B[name]
            inputs = self.lora_dropout[name](self._cast_input_dtype(x, lora_a.weight.dtype))
            hidden = torch.nn.functional.linear(inputs, lora_a.weight * self.scaling[name])
            result = result + lora_b(hidden)  # hidden: [..., r]
        return result.to(dtype)


def _unplain(layer: Linear, adapter: str) -> bool:
    """Whether `adapter`'s factors do more than two bias-free linears: peft scales ``B``'s bias
    (``lora_bias``) with the update, and a hooked ``A`` (tp's redistributions), a DTensor
    weight or another class must run its own forward."""
    lora_a, lora_b = layer.lora_A[adapter], layer.lora_B[adapter]
    return (
        type(lora_a) is not torch.nn.Linear
        or lora_a.bias is not None
        or getattr(lora_b, "bias", None) is not None
        or isinstance(lora_a.weight, DTensor)
        or bool(lora_a._forward_hooks or lora_a._forward_pre_hooks)
    )


def scale_factors(module: torch.nn.Module) -> None:
    """Turn each of `module`'s peft LoRA ``Linear`` layers (that class exactly, not peft's
    other LoRA layers) into a `FactorScaledLinear`, in place."""
    for layer in module.modules():
        if type(layer) is Linear:
            layer.__class__ = FactorScaledLinear
