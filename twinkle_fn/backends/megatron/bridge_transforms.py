"""Pure tensor transforms between HF weight layouts and megatron-core's fused, TP-split ones.

megatron-core fuses q/k/v into one ``linear_qkv`` whose rows are grouped per query (kv) group:
for each group ``g``, the ``num_heads / num_kv_heads`` query heads of ``g``, then ``k_g``, then
``v_g``, each ``head_dim`` rows. It fuses the SwiGLU ``gate`` and ``up`` projections into one
``linear_fc1`` as ``[gate; up]`` *per tensor-parallel rank* (each rank chunks its local output in
two), and pads the vocabulary so that every TP rank holds the same number of rows. Tensor
parallelism splits a dim into equal, contiguous parts. Everything here is shape arithmetic on
tensors; nothing reads files or talks to process groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def even_range(n: int, rank: int, size: int) -> tuple[int, int]:
    """Half-open ``[start, stop)`` that `rank` of `size` holds of a length-`n` dim split evenly.

    Raises ``ValueError`` if `size` does not divide `n` or `rank` is outside ``[0, size)``.
    """
    _check_positive(size=size)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is out of range for size {size}; use 0 <= rank < {size}")
    if n % size:
        raise ValueError(f"a dim of length {n} does not split evenly into {size} parts")
    part = n // size
    return rank * part, (rank + 1) * part


def tp_shard(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """Part `rank` of `size` equal parts of `t` along `dim` (a view).

    Raises ``ValueError`` if ``t.shape[dim]`` is not divisible by `size` or `rank` is out of range.
    """
    start, stop = even_range(t.shape[dim], rank, size)
    return t.narrow(dim, start, stop - start)


def tp_unshard(shards: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """The full tensor from the parts of every rank, in rank order (inverse of `tp_shard`).

    Returns the single shard itself when there is one. Raises ``ValueError`` for no shards.
    """
    if not shards:
        raise ValueError("tp_unshard got no shards; pass one tensor per tensor-parallel rank")
    return shards[0] if len(shards) == 1 else torch.cat(list(shards), dim=dim)


def _group_layout(num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    _check_positive(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}; "
            "grouped-query attention needs whole query groups"
        )
    return num_heads // num_kv_heads


def fuse_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """megatron's ``linear_qkv`` tensor from HF's separate projections (weights or biases).

    q: ``[num_heads * head_dim, *rest]``; k, v: ``[num_kv_heads * head_dim, *rest]`` ->
    ``[num_kv_heads * (num_heads / num_kv_heads + 2) * head_dim, *rest]``, rows grouped per kv
    group as ``[q heads of g; k_g; v_g]``. Raises ``ValueError`` when the heads do not form whole
    groups or a tensor's first dim does not match its head count.
    """
    per_group = _group_layout(num_heads, num_kv_heads, head_dim)
    for name, t, heads in (("q", q, num_heads), ("k", k, num_kv_heads), ("v", v, num_kv_heads)):
        if t.shape[0] != heads * head_dim:
            raise ValueError(
                f"{name} has {t.shape[0]} rows but {heads} heads x head_dim {head_dim} = "
                f"{heads * head_dim} were expected"
            )
    rest = q.shape[1:]
    grouped = torch.cat(
        [
            q.reshape(num_kv_heads, per_group * head_dim, *rest),
            k.reshape(num_kv_heads, head_dim, *rest),
            v.reshape(num_kv_heads, head_dim, *rest),
        ],
        dim=1,
    )
    return grouped.reshape(-1, *rest)


def split_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HF's ``(q, k, v)`` from megatron's fused ``linear_qkv`` tensor (inverse of `fuse_qkv`).

    qkv: ``[num_kv_heads * (num_heads / num_kv_heads + 2) * head_dim, *rest]``. Raises
    ``ValueError`` when the heads do not form whole groups or the row count does not match.
    """
    per_group = _group_layout(num_heads, num_kv_heads, head_dim)
    rows = num_kv_heads * (per_group + 2) * head_dim
    if qkv.shape[0] != rows:
        raise ValueError(
            f"fused qkv has {qkv.shape[0]} rows but {num_kv_heads} groups x "
            f"({per_group} q + k + v heads) x head_dim {head_dim} = {rows} were expected"
        )
    rest = qkv.shape[1:]
    grouped = qkv.reshape(num_kv_heads, (per_group + 2) * head_dim, *rest)
    q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """One rank's ``linear_fc1`` ``[gate; up]`` from its gate and up shards.

    gate, up: ``[ffn_shard, *rest]`` -> ``[2 * ffn_shard, *rest]``. Raises ``ValueError`` when the
    shapes differ.
    """
    if gate.shape != up.shape:
        raise ValueError(
            f"gate {list(gate.shape)} and up {list(up.shape)} must have the same shape to fuse"
        )
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's ``(gate, up)`` shards from its ``linear_fc1`` (inverse of `fuse_gate_up`).

    fc1: ``[2 * ffn_shard, *rest]``. Raises ``ValueError`` when the first dim is odd.
    """
    if fc1.shape[0] % 2:
        raise ValueError(
            f"linear_fc1 has an odd number of rows ({fc1.shape[0]}); expected [gate; up]"
        )
    gate, up = fc1.chunk(2, dim=0)
    return gate, up


def padded_vocab_size(vocab_size: int, tp_size: int, vocab_multiple: int = 128) -> int:
    """Megatron's padded vocabulary: `vocab_size` rounded up to a multiple of ``multiple * tp``.

    This is Megatron-LM's ``make_vocab_size_divisible_by`` rule, so every TP rank of the
    vocab-parallel embedding and output layer holds the same number of rows. Raises
    ``ValueError`` for sizes below 1.
    """
    _check_positive(vocab_size=vocab_size, tp_size=tp_size, vocab_multiple=vocab_multiple)
    step = vocab_multiple * tp_size
    return -(-vocab_size // step) * step


def pad_vocab(t: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """`t` with zero rows appended up to `padded_rows` rows (dim 0); `t` itself when no padding.

    t: ``[rows, *rest]`` -> ``[padded_rows, *rest]``. Raises ``ValueError`` if `t` has more rows.
    """
    rows = t.shape[0]
    if rows > padded_rows:
        raise ValueError(f"cannot pad {rows} rows down to {padded_rows}; padded size is smaller")
    if rows == padded_rows:
        return t
    return torch.cat([t, t.new_zeros(padded_rows - rows, *t.shape[1:])], dim=0)


def unpad_vocab(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The first `rows` rows of a padded vocabulary tensor (a view; inverse of `pad_vocab`).

    t: ``[padded_rows, *rest]`` -> ``[rows, *rest]``. Raises ``ValueError`` if `t` has fewer rows.
    """
    if t.shape[0] < rows:
        raise ValueError(f"tensor has {t.shape[0]} rows, fewer than the vocabulary's {rows}")
    return t[:rows]


def _check_gated_groups(rows: torch.Tensor, what: str, heads_per_group: int, head_dim: int) -> None:
    """Refuse `rows` that are not whole groups of `heads_per_group` (query, gate) heads
    (`what` begins the message: the tensor and its verb)."""
    _check_positive(heads_per_group=heads_per_group, head_dim=head_dim)
    if rows.shape[0] % (2 * heads_per_group * head_dim):
        raise ValueError(
            f"{what} {rows.shape[0]} rows, not whole groups of {heads_per_group} "
            f"heads x (query, gate) x head_dim {head_dim}"
        )


def group_query_gate(q_proj: torch.Tensor, heads_per_group: int, head_dim: int) -> torch.Tensor:
    """A gated ``q_proj`` (HF's Qwen3.5: each head's query, then its gate) with its rows per
    query group as megatron's gated ``linear_qkv`` takes them: the group's queries, then its
    gates.

    q_proj: ``[heads * 2 * head_dim, *rest]`` -> the same shape. Raises ``ValueError`` when the
    rows are not whole groups of `heads_per_group` gated heads.
    """
    _check_gated_groups(q_proj, "gated q_proj has", heads_per_group, head_dim)
    rest = q_proj.shape[1:]
    grouped = q_proj.reshape(-1, heads_per_group, 2, head_dim, *rest).transpose(1, 2)
    return grouped.reshape(q_proj.shape)


def interleave_query_gate(
    grouped: torch.Tensor, heads_per_group: int, head_dim: int
) -> torch.Tensor:
    """HF's gated ``q_proj`` rows from megatron's per-group ``[queries; gates]`` (inverse of
    `group_query_gate`). Raises like it."""
    _check_gated_groups(grouped, "gated queries have", heads_per_group, head_dim)
    rest = grouped.shape[1:]
    heads = grouped.reshape(-1, 2, heads_per_group, head_dim, *rest).transpose(1, 2)
    return heads.reshape(grouped.shape)


def fuse_sections(sections: Sequence[torch.Tensor], rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s rows of a column-parallel linear whose output is several sections, each
    split over `size` ranks on its own (megatron's Gated DeltaNet ``in_proj``: per rank its q,
    k, v, z, beta and alpha heads): its part of each section, concatenated.

    sections: ``[rows_i, *rest]`` -> ``[sum(rows_i) / size, *rest]``. Raises ``ValueError`` when
    `size` does not divide a section.
    """
    return torch.cat([tp_shard(s, 0, rank, size) for s in sections])


def split_sections(shards: Sequence[torch.Tensor], rows: Sequence[int]) -> list[torch.Tensor]:
    """The whole sections (of `rows` rows each) from every rank's `fuse_sections` output, in
    rank order (its inverse over all ranks). Raises ``ValueError`` when a shard is not
    ``sum(rows) / len(shards)`` rows of evenly split sections."""
    size = len(shards)
    local = []
    for n in rows:
        if n % size:
            raise ValueError(f"a section of {n} rows does not split evenly into {size} parts")
        local.append(n // size)
    for shard in shards:
        if shard.shape[0] != sum(local):
            raise ValueError(
                f"a shard of {shard.shape[0]} rows is not {size} ranks' part of sections {rows}"
            )
    parts = [shard.split(local) for shard in shards]
    return [tp_unshard([p[i] for p in parts], 0) for i in range(len(rows))]
