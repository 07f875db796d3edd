"""`SDPAAttention`: megatron-core's core attention computed by torch's SDPA (flash kernels on GPU).

megatron-core's local spec computes attention with an unfused ``[seq, seq]`` matrix (3x slower
than a plain transformers loop on an H200). This module keeps megatron's constructor and
``forward`` signature and computes it with ``torch.nn.functional.scaled_dot_product_attention``;
packed (THD) sequences take a varlen kernel on the GPU (flash-attn's when importable, else
torch's own; `twinkle_fn.varlen_attention`), else SDPA per packed sample; under context
parallelism, SDPA per local chunk over keys and values all-gathered across the
context-parallel group (`twinkle_fn.backends.megatron.context_parallel`).
`twinkle_fn.backends.megatron.spec` puts it in the layer spec.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from torch import Tensor

from twinkle_fn.backends.megatron.context_parallel import context_parallel_attention
from twinkle_fn.backends.megatron.packed_rotary import rotary_freqs, rotate
from twinkle_fn.varlen_attention import packed_attention

_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal)


def _first_set(*values: Tensor | None) -> Tensor | None:
    return next((v for v in values if v is not None), None)


def _same_bounds(cu_q: Tensor, cu_kv: Tensor | None) -> bool:
    """Whether packed key/value boundaries (None: the queries') equal the queries'. The one
    tensor `micro_batches` passes for both is not compared: ``torch.equal`` reads a value, a
    graph break inside every compiled layer (and a host read of two separate CUDA tensors)."""
    return cu_kv is None or cu_kv is cu_q or torch.equal(cu_q, cu_kv)


class SDPAAttention(MegatronModule):
    """megatron-core core attention computed by torch's ``scaled_dot_product_attention``.

    Drop-in for ``DotProductAttention`` (same constructor and ``forward`` signature): inputs
    ``query [sq, b, heads, dim]``, ``key``/``value [sk, b, groups, dim]`` (GQA: heads a multiple
    of groups), output ``[sq, b, heads * dim]``. Multi-latent attention's values may be
    narrower than its queries and keys (``k_channels`` / ``v_channels``, as megatron passes
    them; the shapes come from the tensors): the output is then ``[sq, b, heads * v_dim]``. ``attention_mask`` is megatron's boolean mask
    (True = masked out, broadcastable to ``[b, 1, sq, sk]``), combined with causality and the
    config's sliding window. Packed sequences (``packed_seq_params.qkv_format == 'thd'``) take
    ``[tokens, heads, dim]`` and attend causally within each sample of ``cu_seqlens_q`` (the
    padded boundaries when given); output ``[tokens, heads * dim]``. When they carry each
    token's rotary angles (`twinkle_fn.backends.megatron.packed_rotary`), queries and keys are rotated
    here first: the layer spec's ``SelfAttention`` left that to this module.

    With ``config.context_parallel_size > 1`` the inputs are this rank's two chunks of every
    sequence (of every packed sample for THD, whose boundaries are then the global ones), as
    megatron splits them: keys and values are all-gathered over the context-parallel group
    (`context_parallel.context_parallel_attention`; ``cp_comm_type`` None or ``'all_gather'``).

    Raises ``ValueError`` for a non-vanilla softmax, an attention bias, packed parameters
    without ``cu_seqlens_q``, packed query and key/value boundaries that differ, and under
    context parallelism for another ``cp_comm_type``, an ``attention_mask``, or a sliding
    window without the causal mask.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ) -> None:
        super().__init__(config=config)
        self.cp_group: Any = None
        if config.context_parallel_size > 1:
            if cp_comm_type not in (None, "all_gather"):
                raise ValueError(
                    f"SDPAAttention all-gathers keys and values for context parallelism, got "
                    f"cp_comm_type={cp_comm_type!r}; set cp_comm_type=None or 'all_gather', or "
                    "use TransformerEngine's spec (layer_spec(config, use_te=True))"
                )
            cp = getattr(pg_collection, "cp", None)
            self.cp_group = cp if cp is not None else parallel_state.get_context_parallel_group()
        if config.softmax_type != "vanilla":
            raise ValueError(
                f"SDPAAttention supports softmax_type='vanilla' only, got {config.softmax_type!r}"
            )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = (
            1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        )
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        use_window = is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, self.layer_number
        )
        self.window: tuple[int, int] | None = (
            tuple(config.window_size) if use_window else None  # type: ignore[assignment]
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        """Attention output, ``[sq, b, heads * dim]`` (THD: ``[tokens, heads * dim]``)."""
        if attention_bias is not None:
            raise ValueError("SDPAAttention does not take an attention_bias; pass None")
        freqs = rotary_freqs(packed_seq_params)
        if freqs is not None:
            query, key = rotate(query, freqs), rotate(key, freqs)
        causal = (attn_mask_type or self.attn_mask_type) in _CAUSAL
        dropout_p = self.dropout_p if self.training else 0.0
        # Dropout in the tensor-parallel region draws from megatron's model-parallel RNG stream.
        rng = (
            tensor_parallel.get_cuda_rng_tracker().fork()
            if dropout_p > 0 and not self.config.sequence_parallel
            else contextlib.nullcontext()
        )
        with rng:
            if self.cp_group is not None:
                return self._context_parallel(
                    query, key, value, attention_mask, packed_seq_params, causal, dropout_p
                )
            if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
                return self._packed(query, key, value, packed_seq_params, causal, dropout_p)
            # [s, b, n, d] -> [b, n, s, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = self._attend(q, k, v, attention_mask, causal, dropout_p)
        sq, b = query.shape[:2]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _context_parallel(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        params: PackedSeqParams | None,
        causal: bool,
        dropout_p: float,
    ) -> Tensor:
        """This rank's chunks attending to keys and values gathered over the cp group."""
        if attention_mask is not None:
            raise ValueError(
                "SDPAAttention under context parallelism takes no attention_mask (padding is "
                "masked in the loss); pass attention_mask=None"
            )
        if self.window is not None and not causal:
            raise ValueError(
                "SDPAAttention under context parallelism supports sliding windows with the "
                "causal mask only; use attn_mask_type=causal or cp=1"
            )
        packed = params is not None and params.qkv_format == "thd"
        cu = None
        if packed:
            cu = _first_set(params.cu_seqlens_q_padded, params.cu_seqlens_q)
            cu_kv = _first_set(params.cu_seqlens_kv_padded, params.cu_seqlens_kv)
            if cu is None or not _same_bounds(cu, cu_kv):
                raise ValueError(
                    "packed (thd) attention needs packed_seq_params.cu_seqlens_q, equal to _kv"
                )
            # [tokens, n, d] -> [tokens, 1, n, d]
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
        out = context_parallel_attention(
            query,
            key,
            value,
            lambda q, k, v: self._attend(q, k, v, None, causal, dropout_p),
            group=self.cp_group,
            causal=causal,
            cu_seqlens=cu,
        )
        return out.reshape(out.shape[0], -1) if packed else out.flatten(2)

    def _allowed(
        self, sq: int, sk: int, causal: bool, mask: Tensor | None, device: torch.device
    ) -> Tensor | None:
        """Boolean ``[.., sq, sk]`` mask of allowed pairs, or None when SDPA's own suffices."""
        if mask is None and self.window is None and (not causal or sq == sk):
            return None
        # Queries are the last sq of sk positions (bottom-right aligned, as with a KV cache).
        rel = torch.arange(sk, device=device) - torch.arange(sk - sq, sk, device=device)[:, None]
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=device)
        if causal:
            allowed &= rel <= 0
        if self.window is not None:
            left, right = self.window  # -1: unbounded on that side
            if left >= 0:
                allowed &= rel >= -left
            if right >= 0:
                allowed &= rel <= right
        if mask is not None:
            allowed = allowed & ~mask
        # A row with nothing to attend to (a padding query) would give NaN; let it attend
        # everywhere instead: its output is garbage either way and carries no loss.
        return allowed | ~allowed.any(dim=-1, keepdim=True)

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None,
        causal: bool,
        dropout_p: float,
    ) -> Tensor:
        """SDPA on ``[b, heads, s, dim]`` / ``[b, groups, s, dim]`` tensors."""
        allowed = self._allowed(q.shape[2], k.shape[2], causal, mask, q.device)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=allowed,
            dropout_p=dropout_p,
            is_causal=causal and allowed is None,
            scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )

    def _packed(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        params: PackedSeqParams,
        causal: bool,
        dropout_p: float,
    ) -> Tensor:
        """Per-sample attention over packed ``[tokens, heads, dim]`` tensors."""
        cu_q = _first_set(params.cu_seqlens_q_padded, params.cu_seqlens_q)
        cu_kv = _first_set(params.cu_seqlens_kv_padded, params.cu_seqlens_kv)
        if cu_q is None:
            raise ValueError("packed (thd) attention needs packed_seq_params.cu_seqlens_q")
        if not _same_bounds(cu_q, cu_kv):
            raise ValueError("SDPAAttention packs self-attention only: cu_seqlens_q must equal _kv")
        max_len = params.max_seqlen_q or int((cu_q[1:] - cu_q[:-1]).max())
        out = packed_attention(
            query,
            key,
            value,
            cu_q,
            max_len,
            scale=self.softmax_scale,
            causal=causal,
            window=self.window,
            dropout_p=dropout_p,
        )
        if out is not None:
            # varlen kernels leave the tokens past the last boundary (padding) unwritten
            tail = torch.arange(out.shape[0], device=out.device) >= cu_q[-1]
            out = out.masked_fill(tail[:, None, None], 0.0)
            return out.reshape(out.shape[0], -1)
        bounds = [int(b) for b in cu_q.tolist()]
        pieces = []
        for start, end in itertools.pairwise(bounds):
            if end > start:
                # [len, n, d] -> [1, n, len, d]
                q, k, v = (t[start:end].transpose(0, 1)[None] for t in (query, key, value))
                pieces.append(self._attend(q, k, v, None, causal, dropout_p)[0].transpose(0, 1))
        tail = query.shape[0] - bounds[-1]
        if tail > 0:
            pieces.append(query.new_zeros(tail, *query.shape[1:]))
        return torch.cat(pieces).reshape(query.shape[0], -1)
