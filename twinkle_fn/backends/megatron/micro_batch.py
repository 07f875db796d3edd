"""A twinkle batch as megatron micro-batches, and per-token results back in the batch's layout.

`micro_batches` turns a twinkle batch (padded ``[B, T]`` from ``pad_collate`` or packed ``[1, T]``
with ``cu_seqlens`` from ``pack``, labels already shifted) into ``GPTModel`` inputs, split into
micro-batches; packed ones become THD ``PackedSeqParams``. Under context parallelism each rank
keeps its two chunks of every sequence (of every packed sample), as megatron's rotary embedding
and `twinkle_fn.backends.megatron.context_parallel` expect. A loss's batch fields travel with
their tokens. `merge_logps` is its inverse for per-token values: micro-batches' ``[b, s]``
results (this context-parallel rank's chunks) back into the batch's ``[B, T]`` / ``[1, T]``.

megatron-core's rotary embedding derives positions from the layout (``arange`` per row, or per
packed sample from ``cu_seqlens``), so batches must be right-padded or packed; `micro_batches`
checks that the batch's ``position_ids`` agree.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from twinkle_fn.backends.megatron.context_parallel import (
    global_order,
    sequence_multiple,
    split_packed,
    split_sequence,
)
from twinkle_fn.data import IGNORE_INDEX
from twinkle_fn.data.microbatch import split_batch, split_features
from twinkle_fn.losses import supervised_rows

PAD_TOKEN_ID = 0  # fills positions added to reach a sequence multiple; their labels are ignored


@dataclass(frozen=True)
class MicroBatch:
    """The inputs of one ``GPTModel`` forward.

    ``input_ids``, ``position_ids`` and ``labels`` are int64 ``[b, s]`` (labels already shifted,
    -100 ignored; under context parallelism this rank's ``s // cp`` tokens). ``packed`` holds
    THD boundaries when the row packs several samples (then ``b == 1``; the global boundaries
    under context parallelism), else None. ``supervised_rows`` (set once on the device) are the
    flat indices of the supervised labels in the ``[s, b]`` layout of the last stage's hidden
    states, found before the forward so the fused loss does not sync the host mid-step.
    ``bounds`` are ``packed``'s boundaries as host ints (set exactly when ``packed`` is), so
    that nothing reads them back from the device. ``fields`` are the batch fields a loss reads,
    by name, each laid out like ``labels`` (0 where `micro_batches` added padding). Raises
    ``ValueError`` when only one of ``packed`` and ``bounds`` is set.
    """

    input_ids: Tensor
    position_ids: Tensor
    labels: Tensor
    packed: PackedSeqParams | None = None
    supervised_rows: Tensor | None = None
    bounds: tuple[int, ...] | None = None
    fields: Mapping[str, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.packed is None) != (self.bounds is None):
            raise ValueError(
                "a MicroBatch has bounds (its packed boundaries as host ints) exactly when it "
                "is packed; build micro-batches with micro_batches"
            )


def micro_batches(
    batch: Mapping[str, Any],
    num_micro_batches: int,
    *,
    seq_multiple: int = 1,
    cp_size: int = 1,
    cp_rank: int = 0,
    device: torch.device | str = "cpu",
    fields: Sequence[str] = (),
) -> list[MicroBatch]:
    """Split a padded or packed `batch` into `num_micro_batches` megatron micro-batches.

    Padded batches (``input_ids``/``labels`` ``[B, T]``, optional ``attention_mask`` and
    ``position_ids``) split by rows; packed ones (``[1, T]`` plus ``cu_seqlens [n + 1]``) split
    by samples, each micro-batch a packed row of its own. Sequences are padded at the end with
    ignored labels so that each rank's part divides by `seq_multiple` (sequence parallelism
    splits it over tp); a packed row gets the padding as one more sample. With `cp_size` > 1,
    context-parallel rank `cp_rank` keeps chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank``
    of ``2 * cp_size`` equal ones of each row (of each packed sample, each padded to a multiple
    of ``2 * cp_size``). Tensors are moved to `device`. The batch `fields` named (each shaped
    like ``labels``: a loss's inputs) go along with the labels, 0 on the padding added here.

    Raises ``ValueError`` for missing or misshapen fields, left padding or position ids that
    do not restart per row / per packed sample (megatron's rotary embedding assumes both),
    malformed ``cu_seqlens``, more micro-batches than rows / samples, or a bad
    `cp_size` / `cp_rank`.
    """
    ids, labels = _field(batch, "input_ids"), _field(batch, "labels")
    if ids.shape != labels.shape:
        raise ValueError(
            f"batch input_ids {list(ids.shape)} and labels {list(labels.shape)} differ in shape"
        )
    if isinstance(seq_multiple, bool) or not isinstance(seq_multiple, int) or seq_multiple < 1:
        raise ValueError(f"seq_multiple must be a positive int, got {seq_multiple!r}")
    multiple = sequence_multiple(cp_size, seq_multiple)
    extra = {name: _field(batch, name) for name in fields}
    for name, value in extra.items():
        if value.shape != labels.shape:
            raise ValueError(
                f"batch[{name!r}] {list(value.shape)} and labels {list(labels.shape)} differ in "
                "shape; a loss's batch fields are laid out like the labels"
            )
    if "cu_seqlens" in batch:
        out = _packed(batch, ids, labels, extra, num_micro_batches, multiple, cp_size)
    else:
        out = _padded(batch, ids, labels, extra, num_micro_batches, multiple)
    return [_to(_on_cp_rank(mb, cp_size, cp_rank), torch.device(device)) for mb in out]


def _field(batch: Mapping[str, Any], name: str) -> Tensor:
    if name not in batch:
        raise ValueError(f"batch has no {name!r}; build it with pad_collate or pack")
    value = batch[name]
    if not isinstance(value, Tensor) or value.ndim != 2:
        raise ValueError(f"batch[{name!r}] must be a [batch, seq] tensor, got {value!r}")
    return value


def _pad_cols(t: Tensor, multiple: int, value: int) -> Tensor:
    extra = -t.shape[-1] % multiple
    return torch.nn.functional.pad(t, (0, extra), value=value) if extra else t


def _padded(
    batch: Mapping[str, Any],
    ids: Tensor,
    labels: Tensor,
    extra: Mapping[str, Tensor],
    n: int,
    multiple: int,
) -> list[MicroBatch]:
    length = ids.shape[1]
    real = torch.ones_like(ids, dtype=torch.bool)
    if "attention_mask" in batch:
        real = _field(batch, "attention_mask").bool()
        if bool((real[:, 1:] & ~real[:, :-1]).any()):
            raise ValueError(
                "batch attention_mask has padding before real tokens (left padding); the "
                "megatron backend needs right padding (pad_collate) or packed batches (pack)"
            )
    if "position_ids" in batch:
        pos = _field(batch, "position_ids")
        expected = torch.arange(length, device=pos.device).expand_as(pos)
        # elementwise, not pos[real]: boolean indexing of a [8, 2048] host batch took 22 ms, the
        # GPU idle meanwhile at the start of every step (profiled on an H200)
        if not bool(((pos == expected) | ~real).all()):
            raise ValueError(
                "batch position_ids are not 0..len-1 on the real tokens of each row; megatron's "
                "rotary embedding uses the token's index, so pass right-padded rows"
            )
    ids, labels = _pad_cols(ids, multiple, PAD_TOKEN_ID), _pad_cols(labels, multiple, IGNORE_INDEX)
    positions = torch.arange(ids.shape[1], dtype=torch.int64).expand_as(ids)
    extra = {name: _pad_cols(t, multiple, 0) for name, t in extra.items()}
    layout = {"input_ids": ids, "labels": labels, "position_ids": positions}
    parts = split_batch({**extra, **layout}, n)
    return [
        MicroBatch(p["input_ids"], p["position_ids"], p["labels"], fields={k: p[k] for k in extra})
        for p in parts
    ]


def _bounds(cu_seqlens: Any, total: int) -> list[int]:
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"batch cu_seqlens must be a 1-D tensor [n + 1], got {cu_seqlens!r}")
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != total or any(b < a for a, b in itertools.pairwise(bounds)):
        raise ValueError(
            f"batch cu_seqlens must rise from 0 to the packed length {total}, got {bounds}"
        )
    return bounds


def _packed(
    batch: Mapping[str, Any],
    ids: Tensor,
    labels: Tensor,
    extra: Mapping[str, Tensor],
    n: int,
    multiple: int,
    cp_size: int,
) -> list[MicroBatch]:
    if ids.shape[0] != 1:
        raise ValueError(
            f"a packed batch (with cu_seqlens) has one row, got input_ids {list(ids.shape)}"
        )
    bounds = _bounds(batch["cu_seqlens"], ids.shape[1])
    restart = torch.cat([torch.arange(b - a) for a, b in itertools.pairwise(bounds)])
    if "position_ids" in batch and not torch.equal(_field(batch, "position_ids")[0].cpu(), restart):
        raise ValueError(
            "batch position_ids do not restart at 0 on every packed sample; megatron's rotary "
            "embedding restarts them at each cu_seqlens boundary"
        )
    # Context parallelism cuts every sample into 2 * cp equal chunks.
    unit = 2 * cp_size if cp_size > 1 else 1
    out = []
    for group in split_features(range(len(bounds) - 1), n):
        samples = list(itertools.pairwise(bounds[group[0] : group[-1] + 2]))
        row_ids = torch.cat([_pad_cols(ids[:, a:b], unit, PAD_TOKEN_ID) for a, b in samples], 1)
        row_labels = torch.cat(
            [_pad_cols(labels[:, a:b], unit, IGNORE_INDEX) for a, b in samples], 1
        )
        row_fields = {
            name: _pad_cols(
                torch.cat([_pad_cols(t[:, a:b], unit, 0) for a, b in samples], 1), multiple, 0
            )
            for name, t in extra.items()
        }
        cu = [0, *itertools.accumulate(-(-(b - a) // unit) * unit for a, b in samples)]
        row_ids = _pad_cols(row_ids, multiple, PAD_TOKEN_ID)
        row_labels = _pad_cols(row_labels, multiple, IGNORE_INDEX)
        if row_ids.shape[1] > cu[-1]:
            cu.append(row_ids.shape[1])
        positions = torch.cat([torch.arange(b - a) for a, b in itertools.pairwise(cu)])[None]
        cu_t = torch.tensor(cu, dtype=torch.int32)
        longest = max(b - a for a, b in itertools.pairwise(cu))
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu_t,
            cu_seqlens_kv=cu_t,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        )
        out.append(
            MicroBatch(row_ids, positions, row_labels, params, bounds=tuple(cu), fields=row_fields)
        )
    return out


def _on_cp_rank(mb: MicroBatch, cp_size: int, cp_rank: int) -> MicroBatch:
    """`mb` with only context-parallel rank `cp_rank`'s chunks of each sequence (sample)."""
    if cp_size == 1 and cp_rank == 0:
        return mb

    def local(t: Tensor) -> Tensor:
        if mb.bounds is None:
            return split_sequence(t, cp_size, cp_rank)
        return split_packed(t, mb.bounds, cp_size, cp_rank)

    return replace(
        mb,
        input_ids=local(mb.input_ids),
        position_ids=local(mb.position_ids),
        labels=local(mb.labels),
        fields={name: local(t) for name, t in mb.fields.items()},
    )


def _to(mb: MicroBatch, device: torch.device) -> MicroBatch:
    packed = mb.packed
    if packed is not None:
        cu = packed.cu_seqlens_q.to(device, non_blocking=True)
        packed = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=packed.max_seqlen_q,
            max_seqlen_kv=packed.max_seqlen_kv,
        )
    return MicroBatch(
        mb.input_ids.to(device, non_blocking=True),
        mb.position_ids.to(device, non_blocking=True),
        mb.labels.to(device, non_blocking=True),
        packed,
        supervised_rows(mb.labels.t(), IGNORE_INDEX, device),
        mb.bounds,
        {name: t.to(device, non_blocking=True) for name, t in mb.fields.items()},
    )


def merge_logps(
    batch: Mapping[str, Any],
    batches: Sequence[MicroBatch],
    logps: Sequence[Tensor],
    *,
    cp_group: dist.ProcessGroup | None = None,
) -> Tensor:
    """`forward_backward`'s per-micro-batch `logps` as one tensor in `batch`'s own layout.

    `batches` are the micro-batches `micro_batches` made of `batch`, `logps` their ``[b, s]``
    values (this context-parallel rank's chunks when `cp_group` has several ranks: they are
    all-gathered over it and put back into sequence order). Rows are concatenated back in
    order and the padding `micro_batches` added (to sequence multiples, per packed sample) is
    dropped: returns ``[B, T]`` for a padded batch, ``[1, T]`` for a packed one, on the
    device of `logps`. Every rank of `cp_group` must call it.
    """
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    bounds = [
        [0, mb.labels.shape[1] * cp_size] if mb.bounds is None else mb.bounds for mb in batches
    ]
    if cp_size > 1:
        logps = _gather_cp(logps, bounds, cp_group)
    ids = batch["input_ids"]
    if "cu_seqlens" not in batch:
        return torch.cat(list(logps))[:, : ids.shape[1]]
    # Each sample starts a span padded to a multiple of 2 * cp (see `_packed`).
    unit = 2 * cp_size if cp_size > 1 else 1
    lengths = [b - a for a, b in itertools.pairwise(_bounds(batch["cu_seqlens"], ids.shape[1]))]
    pieces = []
    for group, row in zip(split_features(lengths, len(batches)), logps, strict=True):
        start = 0
        for n in group:
            pieces.append(row[:, start : start + n])
            start += -(-n // unit) * unit
    return torch.cat(pieces, 1)


def _gather_cp(
    logps: Sequence[Tensor], bounds: Sequence[Sequence[int]], group: dist.ProcessGroup
) -> list[Tensor]:
    """Every context-parallel rank's chunks of each micro-batch's ``[b, s / cp]`` `logps`,
    all-gathered in one call and put back into sequence order: ``[b, s]`` each."""
    cp_size = dist.get_world_size(group)
    local = torch.cat([lp.t().reshape(-1) for lp in logps])  # [s / cp, b] each, flattened
    gathered = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(gathered, local, group=group)
    sizes = [lp.numel() for lp in logps]
    per_rank = [g.split(sizes) for g in gathered]
    out = []
    for i, (lp, cu) in enumerate(zip(logps, bounds, strict=True)):
        rows = torch.cat([parts[i].view(lp.shape[1], lp.shape[0]) for parts in per_rank])
        out.append(global_order(rows, cu, cp_size).t())
    return out
