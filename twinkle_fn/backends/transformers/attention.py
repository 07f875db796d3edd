"""The transformers backend's attention: transformers' SDPA, with packed rows on a varlen kernel.

transformers' SDPA path isolates the samples of a packed row with a ``[T, T]`` mask, which
rules out the flash kernels and grows with the square of the row. `NAME` is an attention
implementation registered with transformers (`use_varlen_attention`): it is SDPA, mask
creation included, except for a packed row whose ``cu_seq_lens_q`` reach the attention
(transformers' ``FlashAttentionKwargs``, from `packed_kwargs`): that row goes to
`twinkle_fn.varlen_attention.packed_attention`, or where no varlen kernel runs (CPU,
float32), to SDPA under a block-diagonal mask built from the boundaries on the device.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from twinkle_fn.varlen_attention import block_causal_mask, packed_attention

NAME = "twinkle_sdpa_varlen"
_PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function protocol: `query` ``[B, heads, T, dim]``, `key` /
    `value` ``[B, groups, T, dim]``; returns ``([B, T, heads, dim], None)``.

    Without ``cu_seq_lens_q`` in `kwargs` this is ``sdpa_attention_forward``. With it, the one
    row (``B == 1``) holds packed samples: causal attention within each (and within
    `sliding_window` keys), `attention_mask` unused. Raises ``ValueError`` for a packed batch
    of more than one row.
    """
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(f"a packed batch is one row of samples, got {query.shape[0]} rows")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = _varlen(query, key, value, cu, kwargs["max_length_q"], scale, sliding_window, dropout)
    if out is not None:
        return out, None
    mask = block_causal_mask(cu, query.shape[2], sliding_window)
    rest = {k: v for k, v in kwargs.items() if k not in _PACKED_KWARGS}
    return sdpa_attention_forward(
        module, query, key, value, mask, dropout=dropout, scaling=scaling, **rest
    )


# Outside the compiled graph: the kernels are looked up (and imported) at the first call.
@torch.compiler.disable
def _varlen(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu: Tensor,
    max_len: int,
    scale: float,
    sliding_window: int | None,
    dropout: float,
) -> Tensor | None:
    """`packed_attention` on ``[1, h, T, d]`` inputs; ``[1, T, heads, dim]`` or None."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, h, d]
    window = None if sliding_window is None else (sliding_window - 1, 0)
    out = packed_attention(q, k, v, cu, max_len, scale=scale, window=window, dropout_p=dropout)
    return None if out is None else out[None]


def use_varlen_attention(module: torch.nn.Module) -> bool:
    """Switch an HF model running transformers' SDPA to `NAME` (registering it first).

    Returns whether it did: a model on another attention implementation (eager, flash-attn's
    own) keeps it.
    """
    config = getattr(module, "config", None)
    if not isinstance(module, PreTrainedModel) or config._attn_implementation != "sdpa":
        return False
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    module.set_attn_implementation(NAME)
    return True


def packed_kwargs(
    cu_seqlens: Tensor, max_seqlen: int | None, device: torch.device
) -> dict[str, Any]:
    """The decoder's keyword arguments that route a packed row to `attention_forward`'s varlen
    path: ``cu_seqlens`` ``[n + 1]`` as int32 on `device`, and the longest sample (read from
    ``cu_seqlens`` when `max_seqlen` is None: a host sync if they are on a GPU)."""
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    cu = cu_seqlens.to(device=device, dtype=torch.int32, non_blocking=True)
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": int(max_seqlen),
        "max_length_k": int(max_seqlen),
    }
