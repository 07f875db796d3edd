"""What every upstream-style loss shares: the `Loss` base, and the alignment of per-sample data
(advantages, old / reference log-probs) with each sample's tokens.

A `Loss` is used two ways, as upstream's:

- called, ``loss(inputs, outputs, **kw) -> {'loss', 'num_tokens'}`` on given ``labels`` and
  ``logps`` (or ``logits``) tensors, computing through the core's pure loss functions;
- given to ``model.set_loss(...)``: the model then trains with `Loss.token_loss` (a
  `twinkle_fn.losses.TokenLoss`; None keeps the fused cross entropy) through ``tf.fwd_bwd``,
  the per-sample data of `Loss.model_inputs` carried into the batch by `align_rows`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from twinkle_fn.losses import TokenLoss, token_logps

IGNORE_INDEX = -100


class LossInputError(ValueError, AssertionError):
    """A called loss lacks what it needs. A ``ValueError``; also an ``AssertionError``, which is
    what upstream's losses raise there (``assert``), so upstream callers catch it as before."""


class Loss:
    """Upstream's loss interface (`twinkle.loss.base.Loss`).

    ``require_logits`` / ``require_entropy`` / ``require_logps``: what the model forward must
    give (upstream's flags). ``model_inputs``: the keyword arguments of ``forward_backward`` the
    loss reads (per sample or per token). A subclass says how it trains (`token_loss`,
    `row_weights`) and how it is called (``__call__``).
    """

    require_logits: ClassVar[bool] = False
    require_entropy: bool = False
    require_logps: ClassVar[bool] = True
    model_inputs: ClassVar[tuple[str, ...]] = ()
    ignore_index: int = IGNORE_INDEX

    def token_loss(self) -> TokenLoss | None:
        """The core loss a model trains with (None: the backend's fused cross entropy)."""
        return None

    def required_inputs(self) -> tuple[str, ...]:
        """The `model_inputs` that every ``forward_backward`` call must give."""
        return ()

    def model_data(self, given: Mapping[str, Any], count: int) -> dict[str, Any]:
        """A training call's `given` data (name -> per-sample data, for `count` samples) as
        the batch fields of `token_loss` (by default as given). Raises ``ValueError`` for data
        the loss cannot use."""
        return dict(given)

    def row_weights(self, lengths: Sequence[int]) -> list[float] | None:
        """Per-sample ``loss_weights`` for samples of `lengths` supervised tokens (one
        ``forward_backward`` call), or None when the loss reads none."""
        return None

    @property
    def weighs_rows(self) -> bool:
        """Whether the loss reads per-sample ``loss_weights`` (`row_weights`)."""
        return self.row_weights([1]) is not None

    def __call__(self, inputs: Mapping[str, Any], outputs: Mapping[str, Any], **kwargs: Any) -> Any:
        """``{'loss', 'num_tokens'}`` of `outputs` against `inputs` (see the subclasses)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        # the settings a user gave: not the derived require_* flags, defaults left out
        shown = {
            k: v
            for k, v in vars(self).items()
            if not k.startswith(("_", "require_"))
            and v is not None
            and not (k == "ignore_index" and v == IGNORE_INDEX)
        }
        args = ", ".join(f"{k}={v!r}" for k, v in shown.items())
        return f"{type(self).__name__}({args})"


def labels_of(inputs: Mapping[str, Any], ignore_index: int) -> Tensor:
    """``inputs['labels']`` as an int64 ``[B, T]`` tensor (``[T]`` becomes one row) with -100
    where they hold `ignore_index`. Raises `LossInputError` without labels."""
    labels = inputs.get("labels") if isinstance(inputs, Mapping) else None
    if labels is None:
        raise LossInputError("inputs must contain 'labels' (already shifted, [batch, seq])")
    labels = torch.as_tensor(labels).long()
    if labels.dim() == 1:
        labels = labels.unsqueeze(0)
    return labels.masked_fill(labels == ignore_index, IGNORE_INDEX)


def logps_of(outputs: Mapping[str, Any], labels: Tensor) -> Tensor:
    """``outputs['logps']`` ``[B, T]``, or the core's `token_logps` of ``outputs['logits']``
    ``[B, T', vocab]`` (its last ``T`` positions, as upstream: a multimodal model may put image
    tokens first). Raises `LossInputError` when there is neither."""
    logps = outputs.get("logps")
    if logps is not None:
        return logps
    logits = outputs.get("logits")
    if logits is None:
        raise LossInputError("outputs must contain 'logps' [batch, seq] or 'logits'")
    return token_logps(logits[:, -labels.shape[1] :], labels)


def align_rows(
    name: str,
    value: Any,
    masks: Sequence[Tensor],
    dtype: torch.dtype,
    loss: Loss,
) -> list[Tensor]:
    """`value` (per-sample data named `name`) aligned with each sample's tokens.

    `masks`: per sample, a ``[L_i]`` bool tensor of its supervised tokens. `value` holds one
    entry per sample (a list, a ``[n]`` / ``[n, 1]`` / ``[n, T]`` tensor or array), each
    (upstream's forms, tried in this order) one number, broadcast to the sample's supervised
    tokens; ``n_i`` numbers (its supervised tokens' count: a sampler's response log-probs),
    put at those tokens in order; or at least ``L_i`` numbers (a full row, e.g. a
    ``forward_only`` row right-padded to a longer batch), of which the first ``L_i`` count.
    Returns ``[L_i]`` tensors of `dtype`, 0 on unsupervised tokens.

    Raises ``ValueError`` naming `loss`, the field, the sample and the fix for a count of
    entries other than the samples' or an entry of another length.
    """
    rows = _entries(name, value, len(masks), loss)
    out = []
    for i, (row, mask) in enumerate(zip(rows, masks, strict=True)):
        row = torch.as_tensor(row, dtype=dtype, device="cpu").flatten()
        n_pos, length = int(mask.sum()), mask.numel()
        if row.numel() == 1:
            row = row.expand(length)
        elif row.numel() == n_pos:
            row = torch.zeros(length, dtype=dtype).masked_scatter(mask, row)
        elif row.numel() >= length:
            row = row[:length]
        else:
            raise ValueError(
                f"{loss!r}: {name}[{i}] has {row.numel()} values, but sample {i} has {n_pos} "
                f"supervised tokens of {length}; give one number per sample, one per "
                f"supervised token ({n_pos}), or a full row of at least {length}"
            )
        out.append(torch.where(mask, row, 0.0).to(dtype))
    return out


def _entries(name: str, value: Any, count: int, loss: Loss) -> list[Any]:
    """`value`'s per-sample entries; raises ``ValueError`` unless there are `count`."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if isinstance(value, Tensor):
        value = list(value.unsqueeze(0) if value.dim() == 0 else value)
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ValueError(
            f"{loss!r}: {name} must be a list or tensor with one entry per sample, got "
            f"{type(value).__name__}"
        )
    if len(value) != count:
        raise ValueError(
            f"{loss!r}: {name} has {len(value)} entries for {count} samples; give one entry "
            "per sample (a number, or its per-token values), in the order of inputs"
        )
    return list(value)
