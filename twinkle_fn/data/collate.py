"""Feature validation and padded collation.

A *feature* is one encoded sample, ``{"input_ids": list[int], "labels": list[int]}``, whose labels are
already shifted: ``labels[t]`` is the target for position ``t`` and ``-100`` marks an ignored position.
`pad_collate` turns a list of features into a right-padded batch of int64 tensors.

A feature may carry more numbers for a loss to read (`twinkle_fn.losses.TokenLoss`): a list with
one number per token, aligned with ``labels`` (``old_logps``, ``advantages``...), or one number
per sample (a reward, a sequence weight), broadcast to that sample's tokens. `feature_fields`
turns them into batch fields shaped like ``labels``; collation, packing and splitting carry them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

IGNORE_INDEX = -100
Feature = dict[str, list[int]]
LAYOUT_KEYS = frozenset(
    {"input_ids", "labels", "attention_mask", "position_ids", "cu_seqlens", "max_seqlen"}
)
"""Feature keys that collation (re)builds itself and never carries as batch fields."""

_NO_SUPERVISION = (
    "has no supervised token: every label is -100; check the template's assistant masks or "
    "max_length truncation"
)


def check_features(features: Sequence[Mapping[str, Any]], where: str = "features") -> None:
    """Check that `features` is a non-empty list of well-formed features.

    Each feature needs ``input_ids`` and ``labels``: equally long, non-empty lists of ints.

    Raises:
        TypeError: a feature is not a mapping or a field is not a list of ints.
        ValueError: `features` is empty, a field is missing, empty, or the lengths differ.
    """
    if isinstance(features, Mapping) or not isinstance(features, Sequence):
        raise TypeError(f"{where} must be a list of features, got {type(features).__name__}")
    if len(features) == 0:
        raise ValueError(f"{where} is empty: need at least one feature")
    for i, feature in enumerate(features):
        if not isinstance(feature, Mapping):
            raise TypeError(f"{where}[{i}] must be a dict, got {type(feature).__name__}")
        for field in ("input_ids", "labels"):
            if field not in feature:
                raise ValueError(f"{where}[{i}] has no {field!r}; encode samples with encode_rows")
            value = feature[field]
            if not isinstance(value, Sequence) or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in value
            ):
                raise TypeError(f"{where}[{i}][{field!r}] must be a list of ints")
        n_ids, n_labels = len(feature["input_ids"]), len(feature["labels"])
        if n_ids == 0:
            raise ValueError(f"{where}[{i}]['input_ids'] is empty; drop empty samples")
        if n_ids != n_labels:
            raise ValueError(
                f"{where}[{i}] has {n_ids} input_ids but {n_labels} labels; they must align"
            )


def feature_fields(
    features: Sequence[Mapping[str, Any]], where: str = "features"
) -> dict[str, list[torch.Tensor]]:
    """The batch fields `features` carry: per field name, one 1-D tensor per feature, as long as
    its ``input_ids``.

    A key outside `LAYOUT_KEYS` is a field when its values are numbers (a per-sample value,
    repeated over the sample's tokens) or lists / 1-D tensors of numbers as long as the sample
    (per token, aligned with the already-shifted ``labels``). Its dtype is what ``torch`` makes
    of the values of every feature together (Python ints: int64, floats: float32, bools: bool;
    a tensor keeps its own). Keys whose values are text, mappings or None in every feature are
    not fields and are left out. `features` are assumed well-formed (`check_features`).

    Raises:
        ValueError: a field is missing (or text / None) in some features only, or a per-token
            list's length differs from the sample's.
        TypeError: a field's value is neither a number nor a flat list of numbers.
    """
    keys = dict.fromkeys(k for f in features for k in f if k not in LAYOUT_KEYS)
    out: dict[str, list[torch.Tensor]] = {}
    for key in keys:
        skipped = [_not_a_field(f.get(key)) for f in features]
        if all(skipped):
            continue
        if any(skipped):
            i = skipped.index(True)
            raise ValueError(
                f"{where}[{i}] has no number(s) for {key!r}, which other features carry as a "
                "batch field; give every feature the field (or none)"
            )
        values = [
            _field_values(f[key], len(f["input_ids"]), f"{where}[{i}][{key!r}]")
            for i, f in enumerate(features)
        ]
        dtype = functools.reduce(torch.promote_types, (v.dtype for v in values))
        out[key] = [v.to(dtype) for v in values]
    return out


def _not_a_field(value: Any) -> bool:
    """Whether a feature's `value` is no batch field (text, a mapping, None)."""
    return value is None or isinstance(value, str | bytes | Mapping)


def _field_values(value: Any, length: int, where: str) -> torch.Tensor:
    """`value` (a number, or one per token) as a 1-D tensor of `length` numbers."""
    try:
        t = torch.as_tensor(value, device="cpu")
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{where} must be a number or a list of numbers, got {value!r}") from e
    if t.ndim > 1 or t.dtype.is_complex:
        raise TypeError(f"{where} must be a number or a flat list of numbers, got {value!r}")
    if t.ndim == 0:
        return t.expand(length)
    if t.numel() != length:
        raise ValueError(
            f"{where} has {t.numel()} values but the sample has {length} tokens; a per-token "
            "field aligns with labels (already shifted)"
        )
    return t


def pad_collate(
    features: Sequence[Feature], pad_token_id: int, pad_to_multiple_of: int | None = None
) -> dict[str, torch.Tensor]:
    """Right-pad `features` into a batch.

    Returns int64 tensors, all ``[batch, seq]``: ``input_ids`` (padded with `pad_token_id`),
    ``labels`` (-100 on padding), ``attention_mask`` (1 real, 0 pad) and ``position_ids``
    (0..len-1 over real tokens, 0 on padding); plus each of the features' `feature_fields`,
    ``[batch, seq]`` in its own dtype, 0 on padding. ``seq`` is the longest feature, rounded up
    to a multiple of `pad_to_multiple_of` when given.

    Raises:
        TypeError/ValueError: malformed features (see `check_features` and `feature_fields`),
            or a non-positive `pad_to_multiple_of`.
    """
    check_features(features)
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int):
        raise TypeError(f"pad_token_id must be an int, got {pad_token_id!r}")
    if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be a positive int, got {pad_to_multiple_of}")
    fields = feature_fields(features)
    lengths = [len(f["input_ids"]) for f in features]
    seq = max(lengths)
    if pad_to_multiple_of is not None:
        seq = -(-seq // pad_to_multiple_of) * pad_to_multiple_of
    batch = len(features)
    input_ids = torch.full((batch, seq), pad_token_id, dtype=torch.int64)
    labels = torch.full((batch, seq), IGNORE_INDEX, dtype=torch.int64)
    attention_mask = torch.zeros((batch, seq), dtype=torch.int64)
    position_ids = torch.zeros((batch, seq), dtype=torch.int64)
    for row, (feature, n) in enumerate(zip(features, lengths, strict=True)):
        input_ids[row, :n] = torch.tensor(feature["input_ids"], dtype=torch.int64)
        labels[row, :n] = torch.tensor(feature["labels"], dtype=torch.int64)
        attention_mask[row, :n] = 1
        position_ids[row, :n] = torch.arange(n, dtype=torch.int64)
    batch_fields = {}
    for name, values in fields.items():
        padded = torch.zeros((batch, seq), dtype=values[0].dtype)  # [batch, seq]
        for row, v in enumerate(values):
            padded[row, : v.numel()] = v
        batch_fields[name] = padded
    return {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        **batch_fields,
    }


def num_supervised_tokens(batch: Mapping[str, Any]) -> int:
    """The number of label positions that are not -100 in a padded or packed batch.

    Reading the count back is a host sync if ``labels`` lives on an accelerator.

    Raises:
        ValueError: `batch` has no ``labels``.
    """
    if "labels" not in batch:
        raise ValueError("batch has no 'labels'; build it with pad_collate or pack")
    return int((torch.as_tensor(batch["labels"]) != IGNORE_INDEX).sum())


def check_supervised(
    batch_or_features: Mapping[str, Any] | Sequence[Feature], where: str = "batch"
) -> None:
    """Raise if a batch, or any feature of a list, has no supervised token.

    A token-mean loss over zero tokens is 0/0, so this catches a bad template or an over-eager
    `max_length` before training. It works on host data only: call it before moving the batch
    to a device, so it never forces a device sync.

    Raises:
        ValueError: no label is supervised (naming `where`, and the feature index for a list),
            or the labels live on a non-CPU device.
    """
    if isinstance(batch_or_features, Mapping):
        labels = batch_or_features.get("labels")
        if labels is None:
            raise ValueError(f"{where} has no 'labels'; build it with pad_collate or pack")
        if isinstance(labels, torch.Tensor) and labels.device.type != "cpu":
            raise ValueError(
                f"{where}['labels'] is on {labels.device}; call check_supervised on the CPU "
                "batch, before moving it to the device"
            )
        if num_supervised_tokens(batch_or_features) == 0:
            raise ValueError(f"{where} {_NO_SUPERVISION}")
        return
    check_features(batch_or_features, where)
    for i, feature in enumerate(batch_or_features):
        if all(label == IGNORE_INDEX for label in feature["labels"]):
            raise ValueError(f"{where}[{i}] {_NO_SUPERVISION}")
