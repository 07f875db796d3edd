"""`InputProcessor`: a list of features -> the padded or packed batch `twinkle_fn` trains on."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from twinkle.device_mesh import DeviceMesh
from twinkle_fn.data import pack, pad_collate

FRAMEWORKS = ("transformers",)


class InputProcessor:
    """Collates features (``input_ids`` and already-shifted ``labels``) into a batch.

    Right padding (``input_ids``/``labels``/``attention_mask``/``position_ids``, each
    ``[batch, seq]``) with `pad_collate`, or with ``padding_free=True`` one packed row
    (``[1, total]`` plus ``cu_seqlens``) with `pack`. A feature's own ``attention_mask`` and
    ``position_ids`` are rebuilt (positions 0..n-1 per sample). A feature whose ``position_ids``
    restart at 0 (a `PackingDataset` row) is split there into its samples and the batch is
    packed padding-free, as upstream detects pre-packed rows.
    `device_mesh` is kept for upstream compatibility (the core slices nothing per sample).
    Raises ``ValueError`` for ``padding_side='left'`` and for a framework other than
    ``'transformers'``.
    """

    def __init__(
        self,
        device_mesh: DeviceMesh | None = None,
        padding_free: bool = False,
        framework: str = "transformers",
        padding_side: str = "right",
        pad_token_id: int = 0,
        pad_to_multiple_of: int | None = None,
    ) -> None:
        if framework not in FRAMEWORKS:
            raise ValueError(
                f"framework={framework!r} is not available in this build; use 'transformers'"
            )
        if padding_side != "right":
            raise ValueError(f"padding_side must be 'right', got {padding_side!r}")
        if not isinstance(padding_free, bool):
            raise ValueError(f"padding_free must be a bool, got {padding_free!r}")
        self.device_mesh = device_mesh
        self.padding_free = padding_free
        self.framework = framework
        self.padding_side = padding_side
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(
        self, inputs: Mapping[str, Any] | Sequence[Mapping[str, Any]]
    ) -> dict[str, torch.Tensor]:
        """The batch for `inputs`: features (a list, or one dict) or an already-collated batch.

        A dict whose ``input_ids`` is a 2-D tensor is taken as a collated batch and returned as
        it is. Raises ``TypeError``/``ValueError`` for malformed features (see
        `twinkle_fn.data.check_features`).
        """
        if isinstance(inputs, Mapping):
            ids = inputs.get("input_ids")
            if isinstance(ids, torch.Tensor) and ids.dim() == 2:
                return dict(inputs)
            inputs = [inputs]
        features = [_as_lists(f) for f in inputs]
        split = [part for f in features for part in _split_packed(f)]
        if self.padding_free or len(split) != len(features):
            return pack(split)
        return pad_collate(features, self.pad_token_id, self.pad_to_multiple_of)

    def collate_fn(
        self,
        inputs: Sequence[Mapping[str, Any]],
        micro_batch_size: int | None = None,
        variable_seq_lengths: bool = False,
    ) -> list[dict[str, torch.Tensor]]:
        """`inputs` collated as upstream's ``collate_fn``: a list of batches, one for the whole
        of `inputs`, or one per `micro_batch_size` features (the last may be smaller).

        Micro batches share the whole batch's padded length (``[micro, seq]`` each) unless
        `variable_seq_lengths`, or padding-free collation, gives each its own. Raises
        ``ValueError`` for a `micro_batch_size` that is not a positive int.
        """
        if micro_batch_size is None:
            return [self(list(inputs))]
        if (
            isinstance(micro_batch_size, bool)
            or not isinstance(micro_batch_size, int)
            or micro_batch_size < 1
        ):
            raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
        starts = range(0, len(inputs), micro_batch_size)
        whole = self(list(inputs))
        if variable_seq_lengths or "cu_seqlens" in whole:
            return [self(list(inputs[i : i + micro_batch_size])) for i in starts]
        rows = whole["input_ids"].shape[0]  # [batch, seq]: every [batch, ...] tensor is split
        return [
            {
                k: v[i : i + micro_batch_size]
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows
                else v
                for k, v in whole.items()
            }
            for i in starts
        ]


def unpack(values: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
    """Per-token `values` of `batch` as ``[n_seq, max_len, ...]`` (zeros past each sample's
    end).

    `values` is ``[batch, seq, ...]``: returned as is for a padded batch; for a packed one
    (``[1, total, ...]`` with ``cu_seqlens``) each sample's span becomes one row.
    """
    if "cu_seqlens" not in batch:
        return values
    bounds = batch["cu_seqlens"].tolist()
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    out = values.new_zeros(len(lengths), max(lengths), *values.shape[2:])
    for row, (start, n) in enumerate(zip(bounds[:-1], lengths, strict=True)):
        out[row, :n] = values[0, start : start + n]
    return out


def _as_lists(feature: Any) -> dict[str, Any]:
    """`feature` with tensor/array ``input_ids``/``labels`` turned into lists of ints."""
    if not isinstance(feature, Mapping):
        raise TypeError(f"a feature must be a dict, got {type(feature).__name__}")
    out = dict(feature)
    for key in ("input_ids", "labels"):
        if hasattr(out.get(key), "tolist"):
            out[key] = out[key].tolist()
    return out


def _split_packed(feature: dict[str, Any]) -> list[dict[str, Any]]:
    """`feature` cut where its ``position_ids`` restart at 0 (one piece when they do not)."""
    positions = feature.get("position_ids")
    if hasattr(positions, "tolist"):
        positions = positions.tolist()
    if not isinstance(positions, list) or len(positions) != len(feature["input_ids"]):
        return [feature]
    starts = [i for i, p in enumerate(positions) if p == 0 and i > 0]
    if not starts:
        return [feature]
    bounds = [0, *starts, len(positions)]
    return [
        {"input_ids": feature["input_ids"][a:b], "labels": feature["labels"][a:b]}
        for a, b in itertools.pairwise(bounds)
    ]
