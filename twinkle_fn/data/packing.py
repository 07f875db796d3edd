"""Padding-free packing: many features in one row, separated by ``cu_seqlens``.

Labels are shifted per feature before packing, so the last position of every feature is -100
and no sample is trained to predict the first token of the next.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from twinkle_fn.data.collate import Feature, check_features, feature_fields


def pack(features: Sequence[Feature]) -> dict[str, Any]:
    """Concatenate `features` into one packed row.

    Returns ``input_ids``, ``labels`` and ``position_ids`` as int64 ``[1, total]`` (positions
    restart at 0 for every feature), ``cu_seqlens`` int32 ``[n + 1]`` (feature boundaries,
    starting at 0 and ending at ``total``) and ``max_seqlen`` (an int, the longest feature).
    There is no ``attention_mask``: kernels isolate samples through ``cu_seqlens`` or the mask
    from `packed_attention_mask`. Each of the features' `feature_fields` is concatenated like
    the labels: ``[1, total]`` in its own dtype.

    Raises:
        TypeError/ValueError: malformed features (see `check_features` and `feature_fields`).
    """
    check_features(features)
    fields = feature_fields(features)
    lengths = [len(f["input_ids"]) for f in features]
    input_ids = [t for f in features for t in f["input_ids"]]
    labels = [t for f in features for t in f["labels"]]
    position_ids = torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths])
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return {
        "input_ids": torch.tensor([input_ids], dtype=torch.int64),
        "labels": torch.tensor([labels], dtype=torch.int64),
        "position_ids": position_ids.unsqueeze(0),
        "cu_seqlens": cu_seqlens,
        "max_seqlen": max(lengths),
        **{name: torch.cat(values).unsqueeze(0) for name, values in fields.items()},
    }


def packed_attention_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Block-diagonal causal mask for a packed row; True where a query may attend a key.

    For attention kernels without varlen support (e.g. SDPA on CPU): position ids alone do not
    stop one sample attending the previous ones, this mask does.

    The checks read `cu_seqlens` on the host; build the mask before moving it to a device.

    Args:
        cu_seqlens: ``[n + 1]`` integer boundaries, starting at 0, non-decreasing.
        total: the packed length; must equal ``cu_seqlens[-1]``.

    Returns:
        bool ``[1, 1, total, total]`` (``[batch, heads, query, key]``, broadcastable).

    Raises:
        ValueError: `cu_seqlens` is not 1-D integer, does not start at 0, decreases, or does not
            end at `total`.
    """
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor [n + 1], got {cu_seqlens.dtype} "
            f"of shape {tuple(cu_seqlens.shape)}"
        )
    bounds = cu_seqlens.to(device="cpu", dtype=torch.int64)
    if bounds[0] != 0 or bool((bounds[1:] < bounds[:-1]).any()):
        raise ValueError(f"cu_seqlens must start at 0 and never decrease, got {bounds.tolist()}")
    if bounds[-1] != total:
        raise ValueError(
            f"cu_seqlens ends at {int(bounds[-1])} but total is {total}; pass the packed length"
        )
    positions = torch.arange(total, device=cu_seqlens.device)
    # segment[i] = index of the feature that owns position i
    segment = torch.bucketize(positions, cu_seqlens.to(torch.int64), right=True)
    same_segment = segment[:, None] == segment[None, :]
    causal = positions[:, None] >= positions[None, :]
    return (same_segment & causal)[None, None]


def pack_greedy(features: Sequence[Feature], max_tokens: int) -> list[list[int]]:
    """Group feature indices into packs of at most `max_tokens` tokens (first-fit decreasing).

    Deterministic: features are placed longest first (ties by index) into the first pack with
    room; each pack lists its indices in ascending order, packs in order of creation. Every index
    appears exactly once.

    Raises:
        TypeError/ValueError: malformed features, a non-positive `max_tokens`, or a feature
            longer than `max_tokens` (truncate it with ``max_length``).
    """
    check_features(features)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens}")
    lengths = [len(f["input_ids"]) for f in features]
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ValueError(
                f"features[{i}] has {n} tokens > max_tokens={max_tokens}; encode with "
                f"max_length <= {max_tokens} or raise max_tokens"
            )
    packs: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        slot = next((p for p, free in enumerate(room) if free >= lengths[i]), None)
        if slot is None:
            packs.append([i])
            room.append(max_tokens - lengths[i])
        else:
            packs[slot].append(i)
            room[slot] -= lengths[i]
    return [sorted(p) for p in packs]
