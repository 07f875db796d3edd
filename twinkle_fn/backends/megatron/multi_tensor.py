"""Sync-free stand-ins for the multi-tensor kernels megatron-core takes from TE or apex.

Without TransformerEngine or apex, megatron-core's gradient clipping falls back to
``local_multi_tensor_l2_norm``, which builds the global norm from every gradient's norm read on
the host: one device sync per parameter tensor, every step (170 at Qwen2.5-0.5B; the GPU idles
after each). `install` swaps in torch foreach ops that leave the norm on the device, and a
scale by a device-side coefficient, so megatron takes the path it takes with TE's kernels:
the norm stays a tensor and clipping multiplies by ``min(1, max_norm / norm)`` without reading
it. Where TE or apex provided the kernels, `install` changes nothing.

`scale_grad_buffers` divides the DDP grad buffers by the tokens the same sync-free way, at
foreach's bandwidth.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from megatron.core import utils as mcore_utils
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import clip_grads
from megatron.core.optimizer import optimizer as mcore_optimizer
from torch import Tensor

from twinkle_fn.optim.base import foreach_mul_


def l2_norm(
    chunk_size: int, noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]], *args: object
) -> tuple[Tensor, None]:
    """``amp_C.multi_tensor_l2norm``'s contract: the l2 norm of all of ``tensor_lists[0]`` as
    one vector, a ``[1]`` float32 tensor on their device (no per-tensor norms)."""
    del chunk_size, noop_flag, args  # the kernel's launch details; foreach chooses its own
    norms = torch._foreach_norm(list(tensor_lists[0]), 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def scale(
    chunk_size: int, noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]], factor: object
) -> None:
    """``dst = src * factor`` for each pair of ``tensor_lists = [src, dst]``; `factor` a float
    or a one-element tensor on the tensors' device (read there, never on the host). Separate
    lists are copied (cast to dst's dtype), then scaled in place: no temporary copy of `src`
    (megatron copies its main parameters into the model's this way, with factor 1)."""
    del chunk_size, noop_flag
    src, dst = list(tensor_lists[0]), list(tensor_lists[1])
    if isinstance(factor, Tensor):
        factor = factor.reshape(())
    if not all(s is d for s, d in zip(src, dst, strict=True)):
        torch._foreach_copy_(dst, src)
    if isinstance(factor, Tensor) or factor != 1:
        torch._foreach_mul_(dst, factor)


def install() -> None:
    """Replace megatron-core's local multi-tensor fallbacks (and only those) by `l2_norm` and
    `scale`; idempotent."""
    if clip_grads.l2_norm_impl is mcore_utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = l2_norm
        clip_grads.multi_tensor_scale_impl = scale
        clip_grads.multi_tensor_scale_tensor_impl = scale
    if getattr(mcore_optimizer, "multi_tensor_scale_impl", None) is (
        mcore_utils.local_multi_tensor_scale
    ):
        mcore_optimizer.multi_tensor_scale_impl = scale


def scale_grad_buffers(chunks: Sequence[DistributedDataParallel], factor: Tensor) -> None:
    """Multiply every gradient of `chunks`' DDP grad buffers (and any separate main grads) in
    place by the 0-d `factor`, with no host sync: the product megatron's ``scale_gradients``
    computes, whose ``grad_data *= factor`` broadcasts a 0-d device operand through a generic
    strided kernel (18 ms over a 4B-parameter float32 buffer on an H200, where foreach's
    multiply is bandwidth-bound)."""
    grads: list[Tensor] = []
    for chunk in chunks:
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            grads.append(buffer.grad_data)
            grads.extend(buffer.extra_main_grads)
    foreach_mul_(grads, factor)
