"""Checks of a batch at the core's entry (`tf.fwd_bwd`, `tf.evaluate`, `tf.token_logps`), before
any compute, so that a bad batch is refused with its field, value and fix rather than torch's
``index out of range in self`` from deep inside an embedding.

Structure and dtypes are metadata and always checked. Value checks (token ids within the
vocabulary, supervised labels present, sequence lengths within the position table) read the
batch's tensors; they run only while the batch is still on the host (CPU tensors, as the
collators build it), where a min/max costs a few microseconds and makes no device wait. A
batch already on an accelerator skips them: reading it would make the host wait for the device
on every micro-batch (the training step is otherwise free of host syncs).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from twinkle_fn.data.collate import IGNORE_INDEX

_FIX_IDS = "encode it with the model's own tokenizer (tf.data.pad_collate / tf.data.pack)"


def check_batch(
    batch: Mapping[str, torch.Tensor],
    config: object,
    *,
    where: str,
    supervised: bool = False,
    single_process: bool = True,
) -> None:
    """Refuse `batch` for `config` (an HF config: ``vocab_size``, ``max_position_embeddings``)
    before any compute; `where` names the calling function in messages.

    `batch` needs integer ``input_ids`` and ``labels`` of one shape (``[B, T]``). On the host
    (see the module docstring): every id in ``[0, vocab_size)``, every label there or -100, no
    sequence longer than ``max_position_embeddings`` (from ``position_ids``, else
    ``cu_seqlens``, else ``T``), and with `supervised` and `single_process` at least one label
    that is not -100 (on several ranks one rank's micro-batch may hold none while the others'
    do, and a refusal on one rank would leave the others waiting in a collective).

    Raises ``TypeError`` for a batch that is not a mapping of tensors or has float ids or
    labels, ``ValueError`` for a missing field, other shapes, or a value out of range.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"{where}: batch must be a dict of tensors, got {type(batch).__name__}; build it "
            "with tf.data.pad_collate or tf.data.pack"
        )
    ids, labels = _field(batch, "input_ids", where), _field(batch, "labels", where)
    if ids.shape != labels.shape or ids.dim() != 2:
        raise ValueError(
            f"{where}: input_ids {tuple(ids.shape)} and labels {tuple(labels.shape)} must share "
            "one [batch, seq] shape (labels already shifted); build the batch with "
            "tf.data.pad_collate or tf.data.pack"
        )
    if ids.device.type != "cpu":
        return
    vocab = config.vocab_size
    _check_range(ids, "input_ids", vocab, where, allow_ignore=False)
    _check_range(labels, "labels", vocab, where, allow_ignore=True)
    _check_length(batch, ids, getattr(config, "max_position_embeddings", None), where)
    if supervised and single_process and not bool((labels != IGNORE_INDEX).any()):
        raise ValueError(
            f"{where}: every label of this batch is {IGNORE_INDEX} (no supervised token), so a "
            "step would apply zero gradients; check the template's assistant masks or the "
            "max_length truncation, or drop such samples before collating"
        )


def _field(batch: Mapping[str, torch.Tensor], name: str, where: str) -> torch.Tensor:
    """``batch[name]``, checked to be an integer tensor."""
    if name not in batch:
        raise ValueError(
            f"{where}: batch has no {name!r} (fields: {sorted(batch)}); a batch needs input_ids "
            "and labels shifted by one, -100 where no token is supervised: tf.data.pad_collate "
            "and tf.data.pack build them"
        )
    value = batch[name]
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{where}: batch[{name!r}] must be a tensor, got {type(value).__name__}; build the "
            "batch with tf.data.pad_collate or tf.data.pack"
        )
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(
            f"{where}: batch[{name!r}] holds {value.dtype}, token ids must be integers; "
            f"convert it with .long()"
        )
    return value


def _check_range(
    tensor: torch.Tensor, name: str, vocab: int, where: str, *, allow_ignore: bool
) -> None:
    """Refuse a token id outside ``[0, vocab)`` (-100 allowed in labels); one reduction."""
    if tensor.numel() == 0:
        return
    # an ignored label reads as 0, which is in range: no data-dependent boolean indexing
    values = torch.where(tensor == IGNORE_INDEX, 0, tensor) if allow_ignore else tensor
    low, high = (int(v) for v in torch.aminmax(values))
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise ValueError(
            f"{where}: batch[{name!r}] holds token id {bad}, outside the model's vocabulary "
            f"[0, {vocab}){' (or -100 for an ignored label)' if allow_ignore else ''}; "
            f"{_FIX_IDS}"
        )


def _check_length(
    batch: Mapping[str, torch.Tensor], ids: torch.Tensor, limit: int | None, where: str
) -> None:
    """Refuse a sequence longer than the model's position table (`limit` positions)."""
    if limit is None or ids.numel() == 0:
        return
    positions, bounds = batch.get("position_ids"), batch.get("cu_seqlens")
    if isinstance(positions, torch.Tensor) and positions.device.type == "cpu":
        longest = int(positions.max()) + 1
    elif isinstance(bounds, torch.Tensor) and bounds.device.type == "cpu" and bounds.numel() > 1:
        longest = int(bounds.diff().max())
    else:
        longest = ids.shape[-1]
    if longest > limit:
        raise ValueError(
            f"{where}: a sequence of this batch is {longest} tokens long, but the model has "
            f"max_position_embeddings={limit}; truncate samples to max_length <= {limit} (or "
            "split them) before collating"
        )
