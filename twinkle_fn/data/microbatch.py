"""Splitting a step's data into micro-batches for gradient accumulation."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


def _split_sizes(n: int, parts: int, what: str) -> list[int]:
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"num_micro_batches must be a positive int, got {parts!r}")
    if n < parts:
        raise ValueError(
            f"cannot split {n} {what} into {parts} micro-batches: each needs at least one; "
            "lower num_micro_batches or raise the batch size"
        )
    base, extra = divmod(n, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def split_features[T](features: Sequence[T], num_micro_batches: int) -> list[list[T]]:
    """Split `features` into `num_micro_batches` contiguous lists.

    Sizes differ by at most one (the first ``len % num_micro_batches`` lists get the extra one);
    concatenating the result gives back `features`.

    Raises:
        ValueError: `num_micro_batches` is not a positive int, or exceeds ``len(features)``.
    """
    sizes = _split_sizes(len(features), num_micro_batches, "features")
    out: list[list[T]] = []
    start = 0
    for size in sizes:
        out.append(list(features[start : start + size]))
        start += size
    return out


def split_batch(batch: Mapping[str, Any], num_micro_batches: int) -> list[dict[str, torch.Tensor]]:
    """Split a padded batch (every value a ``[batch, ...]`` tensor) along dim 0.

    Same sizes as `split_features`. The pieces are views of the input tensors; every key is
    split, batch fields for a loss (``advantages`` ``[batch, seq]``...) included.

    Raises:
        ValueError: a packed batch (it has ``cu_seqlens``: split the features, then pack each
            micro-batch), an empty batch, tensors that disagree on the batch size, or a bad
            `num_micro_batches`.
        TypeError: a value is not a tensor.
    """
    if "cu_seqlens" in batch:
        raise ValueError(
            "split_batch got a packed batch (it has 'cu_seqlens'); split the features with "
            "split_features, then pack each micro-batch"
        )
    if not batch:
        raise ValueError("split_batch got an empty batch")
    sizes: dict[str, int] = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.ndim == 0:
            raise TypeError(f"batch[{key!r}] must be a [batch, ...] tensor, got {value!r}")
        sizes[key] = value.shape[0]
    if len(set(sizes.values())) != 1:
        raise ValueError(f"batch tensors disagree on the batch size (dim 0): {sizes}")
    split = _split_sizes(next(iter(sizes.values())), num_micro_batches, "rows")
    pieces = {key: torch.split(value, split, dim=0) for key, value in batch.items()}
    return [{key: pieces[key][i] for key in batch} for i in range(num_micro_batches)]
