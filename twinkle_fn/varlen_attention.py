"""Causal attention over packed samples by a varlen kernel: no padding, no ``[T, T]`` mask.

A packed row holds several samples back to back, separated by ``cu_seqlens``. `packed_attention`
hands it to flash-attn's ``flash_attn_varlen_func`` when flash-attn is importable, else to torch's
own flash kernel (``torch.nn.attention.varlen.varlen_attn``, CUDA, torch >= 2.9), and returns
None where neither takes the inputs (a CPU tensor, float32, dropout without flash-attn), so the
caller falls back to masked SDPA. `block_causal_mask` is that fallback's mask, built on the
device without reading ``cu_seqlens`` on the host.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import Tensor

_HALF = (torch.float16, torch.bfloat16)


def _flash_varlen() -> Callable[..., Tensor] | None:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def _torch_varlen() -> Callable[..., Tensor] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


# Looked up once, at import: called inside a compiled layer, an import attempt (or a
# functools.cache around one) is a graph break in every layer; module constants are guards.
FLASH_VARLEN = _flash_varlen()
"""flash-attn's ``flash_attn_varlen_func`` if flash-attn is importable, else None."""
TORCH_VARLEN = _torch_varlen()
"""torch's ``varlen_attn`` (its bundled flash kernel) if this torch has it, else None."""
# torch < 2.13's varlen_attn takes as many key / value heads as query heads
_TORCH_VARLEN_GQA = TORCH_VARLEN is not None and (
    "enable_gqa" in inspect.signature(TORCH_VARLEN).parameters
)


def packed_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    *,
    scale: float,
    causal: bool = True,
    window: tuple[int, int] | None = None,
    dropout_p: float = 0.0,
) -> Tensor | None:
    """Attention within each packed sample, or None when no varlen kernel takes the inputs.

    `query` ``[T, heads, dim]``, `key` / `value` ``[T, groups, dim]`` (GQA: heads a multiple of
    groups), `cu_seqlens` ``[n + 1]`` sample boundaries on the inputs' device (0 first, T
    last), `max_seqlen` the longest sample (a host int, so nothing is read on the device).
    `window` is flash-attn's ``(left, right)`` sliding window (None: unbounded). Returns
    ``[T, heads, dim]``. flash-attn runs float16 / bfloat16 tensors (it is CUDA-only) with any
    dropout; torch's kernel float16 / bfloat16 CUDA tensors without dropout.
    """
    if query.dtype not in _HALF:
        return None
    cu = cu_seqlens.to(torch.int32)
    left, right = window or (-1, -1)
    if FLASH_VARLEN is not None:
        return FLASH_VARLEN(
            query,
            key,
            value,
            cu,
            cu,
            max_seqlen,
            max_seqlen,
            dropout_p=dropout_p,
            softmax_scale=scale,
            causal=causal,
            window_size=(left, right),
        )
    if TORCH_VARLEN is None or not query.is_cuda or dropout_p > 0.0:
        return None
    kwargs = {}
    if query.shape[1] != key.shape[1]:
        if _TORCH_VARLEN_GQA:
            kwargs["enable_gqa"] = True
        else:
            groups = query.shape[1] // key.shape[1]
            key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    # flash's causal mask is a window reaching no key to the right of the query
    window_size = (left, 0) if causal else (left, right)
    return TORCH_VARLEN(
        query,
        key,
        value,
        cu,
        cu,
        max_seqlen,
        max_seqlen,
        scale=scale,
        window_size=window_size,
        **kwargs,
    )


def block_causal_mask(cu_seqlens: Tensor, total: int, window: int | None = None) -> Tensor:
    """bool ``[1, 1, total, total]``, True where a query may attend a key: same sample, key not
    after the query and, with `window`, fewer than `window` positions before it.

    Built with device ops from `cu_seqlens` (``[n + 1]``, ending at `total`) on its device; no
    value is read on the host. For kernels without varlen support.
    """
    positions = torch.arange(total, device=cu_seqlens.device)
    sample = torch.bucketize(positions, cu_seqlens.to(torch.int64), right=True)  # [total]
    allowed = (sample[:, None] == sample[None, :]) & (positions[:, None] >= positions[None, :])
    if window is not None:
        allowed &= positions[:, None] - positions[None, :] < window
    return allowed[None, None]
