"""Upstream's `CrossEntropyLoss`: the causal-LM cross entropy, the models' default loss.

Trained by a model, it is the backend's fused linear + cross-entropy kernel (`token_loss` is
None), normalised exactly over every micro-batch and data rank of a step whatever
``reduction`` says. Called, it is upstream's: the token mean (``reduction='mean'``, with
``num_tokens`` 0) or the token sum and its count (``'sum'``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from twinkle.loss.base import Loss, labels_of, logps_of
from twinkle_fn.losses import token_logps

REDUCTIONS = ("mean", "sum")


class CrossEntropyLoss(Loss):
    """``-log p(label)`` over the supervised tokens. Raises ``ValueError`` for a `reduction`
    outside `REDUCTIONS` and for ``dft=True`` (DFT's ``-p log p`` weighting is not in the
    core)."""

    def __init__(
        self, ignore_index: int = -100, reduction: str = "mean", dft: bool = False, **kwargs: Any
    ) -> None:
        if reduction not in REDUCTIONS:
            raise ValueError(f"CrossEntropyLoss: reduction must be one of {REDUCTIONS}")
        if dft:
            raise ValueError(
                "CrossEntropyLoss(dft=True) is not available: the core's cross entropy has no "
                "DFT weighting; use dft=False"
            )
        self.ignore_index = ignore_index
        self.reduction = reduction

    def __call__(
        self, inputs: Mapping[str, Any], outputs: Mapping[str, Any], **kwargs: Any
    ) -> dict[str, Any]:
        """The cross entropy of ``outputs['logps']`` (or of ``outputs['logits']`` ``[..., vocab]``
        through the core's `token_logps`) against ``inputs['labels']`` (any shape ``[...]``): ``{'loss': mean,
        'num_tokens': 0}``, or with ``reduction='sum'`` ``{'loss': sum, 'num_tokens': count}``
        (count at least 1, as upstream). Raises `LossInputError` without labels or logps."""
        labels = labels_of(inputs, self.ignore_index).reshape(-1)  # [N], any leading shape
        logps = outputs.get("logps")
        if logps is None and outputs.get("logits") is not None:
            logits = outputs["logits"]
            logps = token_logps(logits.reshape(-1, logits.shape[-1]), labels)
        logps = logps_of({"logps": logps}, labels).reshape(-1)  # [N]
        mask = labels != -100
        loss_sum = -torch.where(mask, logps, 0.0).sum()
        count = mask.sum().clamp(min=1)
        if self.reduction == "sum":
            return {"loss": loss_sum, "num_tokens": count}
        return {"loss": loss_sum / count, "num_tokens": 0}
