"""Context parallelism without TransformerEngine: the batch split and an all-gather attention.

megatron-core splits every sequence into ``2 * cp`` equal chunks and gives context-parallel rank
``r`` chunks ``r`` and ``2 * cp - 1 - r`` (so that under a causal mask every rank does the same
work); its rotary embedding picks those chunks' positions (``get_pos_emb_on_this_cp_rank``, and
per packed sample for THD). Here:

- `sequence_multiple`, `split_sequence` and `split_packed` cut a batch that way before the model
  runs (a packed row per sample, each sample padded to a multiple of ``2 * cp``);
- `context_parallel_attention` attends this rank's query chunks to the whole sequence: keys and
  values are all-gathered over the context-parallel group (megatron's
  ``gather_from_sequence_parallel_region``: its backward reduce-scatters, summing every rank's
  gradient of a slice back to the slice's owner), put back into sequence order, and each query
  chunk attends to the keys up to its own end (causal) or to its whole sequence.

This is megatron's ``cp_comm_type='all_gather'``: attention compute and every other activation
split over cp, but each rank keeps the whole sequence's keys and values of every layer for the
backward pass (``2 * groups / tp * dim`` values a token, a fraction of one hidden state for GQA).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from torch import Tensor

# attend(q [b, heads, sq, dim], k / v [b, groups, sk, dim]) -> [b, heads, sq, dim]; under a
# causal mask the queries are the last sq of the sk key positions.
Attend = Callable[[Tensor, Tensor, Tensor], Tensor]


class _Piece(NamedTuple):
    """One chunk of a context-parallel rank's local sequence."""

    local: int  # offset in the rank's local sequence
    start: int  # offset in the global sequence
    length: int
    segment: tuple[int, int]  # global bounds of the sequence (packed sample) it belongs to


def _check_cp(cp_size: int, cp_rank: int) -> None:
    for name, value in (("cp_size", cp_size), ("cp_rank", cp_rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"need cp_size >= 1 and 0 <= cp_rank < cp_size, got {cp_size}, {cp_rank}")


def sequence_multiple(cp_size: int, local_multiple: int = 1) -> int:
    """What a sequence's length must divide by so that it splits into ``2 * cp_size`` equal
    chunks and each rank's two chunks together divide by `local_multiple` (tp under sequence
    parallelism). `local_multiple` itself when ``cp_size == 1``. Raises ``ValueError`` unless
    both are positive ints."""
    _check_cp(cp_size, 0)
    if (
        isinstance(local_multiple, bool)
        or not isinstance(local_multiple, int)
        or local_multiple < 1
    ):
        raise ValueError(f"local_multiple must be a positive int, got {local_multiple!r}")
    if cp_size == 1:
        return local_multiple
    return math.lcm(2 * cp_size, cp_size * local_multiple)


def _pieces(bounds: Sequence[int], cp_size: int, cp_rank: int) -> list[_Piece]:
    """Rank `cp_rank`'s chunks of every sequence in `bounds`, in its local order."""
    pieces = []
    for a, b in itertools.pairwise(bounds):
        chunk = (b - a) // (2 * cp_size)
        for half, index in enumerate((cp_rank, 2 * cp_size - 1 - cp_rank)):
            pieces.append(_Piece(a // cp_size + half * chunk, a + index * chunk, chunk, (a, b)))
    return pieces


def _check_bounds(bounds: Sequence[int], total: int, cp_size: int) -> None:
    if bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(
            f"sequence bounds must run from 0 to the global length {total}, got {list(bounds)}"
        )
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    if any(n < 0 or n % (2 * cp_size) for n in lengths):
        raise ValueError(
            f"context parallelism over {cp_size} ranks splits each sequence into {2 * cp_size} "
            f"equal chunks, but the lengths are {lengths}; pad each sequence (packed sample) to "
            f"a multiple of {2 * cp_size} (twinkle_fn.backends.megatron.micro_batch.micro_batches does)"
        )


def split_sequence(t: Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> Tensor:
    """Rank `cp_rank`'s chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of `t` along `dim`.

    `t`: ``[..., seq, ...]`` with ``seq`` at `dim` (``[batch, seq]`` for token ids); returns
    ``[..., seq // cp_size, ...]``. Raises ``ValueError`` for a bad `cp_size` / `cp_rank` or a
    ``seq`` that is not a multiple of ``2 * cp_size``.
    """
    return split_packed(t, [0, t.shape[dim]], cp_size, cp_rank, dim)


def split_packed(
    t: Tensor, cu_seqlens: Sequence[int], cp_size: int, cp_rank: int, dim: int = 1
) -> Tensor:
    """Rank `cp_rank`'s two chunks of every packed sample of `t` along `dim`, sample by sample.

    `t`: ``[..., tokens, ...]`` (``[1, tokens]`` for a packed row); `cu_seqlens`: the samples'
    boundaries ``[0, ..., tokens]``, each length a multiple of ``2 * cp_size``. Returns
    ``[..., tokens // cp_size, ...]``, the THD layout megatron's rotary embedding expects.
    Raises ``ValueError`` for a bad `cp_size` / `cp_rank` or boundaries that do not fit.
    """
    _check_cp(cp_size, cp_rank)
    bounds = [int(b) for b in cu_seqlens]
    _check_bounds(bounds, t.shape[dim], cp_size)
    if cp_size == 1:
        return t
    pieces = _pieces(bounds, cp_size, cp_rank)
    return torch.cat([t.narrow(dim, p.start, p.length) for p in pieces], dim=dim)


def global_order(gathered: Tensor, bounds: Sequence[int], cp_size: int) -> Tensor:
    """Gathered ``[cp * local, ...]`` (rank after rank) -> ``[global, ...]`` in sequence order."""
    local = gathered.shape[0] // cp_size
    source = torch.empty(gathered.shape[0], dtype=torch.long)
    for rank in range(cp_size):
        for p in _pieces(bounds, cp_size, rank):
            first = rank * local + p.local
            source[p.start : p.start + p.length] = torch.arange(first, first + p.length)
    return gathered.index_select(0, source.to(gathered.device))


def context_parallel_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attend: Attend,
    *,
    group: dist.ProcessGroup,
    causal: bool,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """Attention of this rank's query chunks to the whole sequence, keys gathered over `group`.

    `query` ``[s, b, heads, dim]``, `key` / `value` ``[s, b, groups, dim]``: this rank's chunks
    of each sequence (`split_sequence` / `split_packed` layout; for packed THD input pass
    ``[tokens, 1, n, dim]`` and the global boundaries `cu_seqlens` ``[samples + 1]``, each
    sample a multiple of ``2 * cp`` long). Every chunk goes through `attend` with the keys of its
    own sequence: up to the chunk's end when `causal` (so the queries are the last positions
    of the keys, as `attend` assumes), else all of them. Returns ``[s, b, heads, dim]``.
    Gradients flow to `key` and `value` of every rank (summed by the gather's reduce-scatter).

    Raises ``ValueError`` when the local length does not fit the boundaries (see `split_packed`).
    """
    cp_size, cp_rank = group.size(), group.rank()
    total = query.shape[0] * cp_size
    bounds = [0, total] if cu_seqlens is None else [int(b) for b in cu_seqlens.tolist()]
    _check_bounds(bounds, total, cp_size)
    keys, values = (
        global_order(gather_from_sequence_parallel_region(t, group=group), bounds, cp_size)
        for t in (key, value)
    )
    outs = []
    for p in _pieces(bounds, cp_size, cp_rank):
        if p.length == 0:
            continue
        # [s, b, n, d] -> [b, n, s, d]
        q = query[p.local : p.local + p.length].permute(1, 2, 0, 3)
        first, stop = p.segment[0], (p.start + p.length if causal else p.segment[1])
        k, v = (t[first:stop].permute(1, 2, 0, 3) for t in (keys, values))
        outs.append(attend(q, k, v).permute(2, 0, 1, 3))
    return torch.cat(outs)
