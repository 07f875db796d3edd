"""Rotary embeddings of a packed (THD) row from each token's position, with no host sync.

megatron-core rotates a packed row's queries and keys sample by sample: in every layer it reads
the sample boundaries on the host (``cu_seqlens.tolist()``), splits the row and rotates each
piece, so each layer waits for the GPU, launches a rotation per sample and, under
``torch.compile``, breaks its graph there. A token's rotary angles depend only on its position
within its sample, and the micro-batch already holds those positions on the device:

- `with_rotary` gathers every token's angles from the model's own rotary table once per
  micro-batch into `RotaryPackedSeqParams` (megatron's ``PackedSeqParams`` plus the angles);
- the layer spec's ``SelfAttention`` (`twinkle_fn.backends.megatron.spec`) then skips megatron's
  rotation of such a row, and `SDPAAttention` rotates its queries and keys with `rotate`, the
  whole row in one pass.

Models whose rotary embedding is not megatron's plain ``RotaryEmbedding`` in its
non-interleaved layout (YaRN, multimodal, interleaved) keep megatron's own rotation.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.utils import unwrap_model
from torch import Tensor


@dataclasses.dataclass
class RotaryPackedSeqParams(PackedSeqParams):
    """megatron's ``PackedSeqParams`` for a THD row, plus ``rotary_freqs``: each token's rotary
    angles, float32 ``[tokens, 1, 1, rot_dim]`` (this context-parallel rank's tokens, in the
    row's order), to be applied by the core attention rather than by megatron."""

    rotary_freqs: Tensor | None = None


def rotary_freqs(params: PackedSeqParams | None) -> Tensor | None:
    """The per-token angles `params` carries for the core attention, else None."""
    return getattr(params, "rotary_freqs", None)


def with_rotary(
    params: PackedSeqParams, model: torch.nn.Module, position_ids: Tensor
) -> PackedSeqParams:
    """`params` carrying the angles of every token of the packed row, where they apply.

    `model` is a ``GPTModel``, bare or wrapped (DDP, ``Float16Module``); `position_ids`
    ``[1, tokens]`` int64 on the model's device holds each token's position within its sample
    (this context-parallel rank's tokens), all below ``params.max_seqlen_q``. The angles are
    ``table[position_ids]`` of megatron's own table for positions ``0..max_seqlen_q - 1``, so
    they are the ones megatron's per-sample rotation would use, and nothing is read on the
    host. Returns `params` unchanged for a row that is not THD, or a model whose rotary
    embedding is not a plain, non-interleaved ``RotaryEmbedding`` (megatron then rotates).
    """
    gpt = unwrap_model(model)
    rotary = getattr(gpt, "rotary_pos_emb", None)
    if (
        params.qkv_format != "thd"
        or type(rotary) is not RotaryEmbedding
        or rotary.rotary_interleaved
        or gpt.config.multi_latent_attention
    ):
        return params
    table = rotary(params.max_seqlen_q, packed_seq=True)  # [max_seqlen, 1, 1, rot_dim]
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(PackedSeqParams)}
    return RotaryPackedSeqParams(**fields, rotary_freqs=table[position_ids.reshape(-1)])


def rotate(t: Tensor, freqs: Tensor) -> Tensor:
    """`t` ``[tokens, heads, dim]`` with its first ``rot_dim`` channels rotated by `freqs`
    (float32 ``[tokens, 1, 1, rot_dim]``), the rest passed through.

    megatron's non-interleaved rotation, op for op (so bit for bit): the halves ``x1, x2`` of
    the rotated channels become ``x * cos + [-x2, x1] * sin``, with ``cos`` and ``sin`` of the
    float32 angles rounded to `t`'s dtype first.
    """
    rot_dim = freqs.shape[-1]
    angles = freqs.reshape(freqs.shape[0], 1, rot_dim)  # [tokens, 1, rot_dim]
    x, rest = t[..., :rot_dim], t[..., rot_dim:]
    cos, sin = torch.cos(angles).to(t.dtype), torch.sin(angles).to(t.dtype)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    out = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
