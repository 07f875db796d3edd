"""Weighted cross entropy: per-token loss scales for SFT masks, as a `TokenLoss`.

Per supervised token ``t``: ``-loss_scale_t * log p(label_t)``, counting the supervised tokens,
so ``tf.step`` takes the mean over every supervised token of the step (ms-swift's and upstream
Twinkle's ``loss_scale``: a weight of 0 adds nothing to the sum but still counts; a token that
must leave the mean too gets the label -100). The field ``loss_scale`` is per token, or one
number per sample that collation broadcasts. With every scale 1 it is the default cross
entropy, computed from the logits (`twinkle_fn.losses.token_loss`) instead of the fused kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from twinkle_fn.losses.cross_entropy import LossOutput
from twinkle_fn.losses.token_loss import TokenInputs


@dataclass(frozen=True)
class WeightedCrossEntropy:
    """The loss of the module docstring (build it with `weighted_cross_entropy`). Reads
    ``loss_scale``; needs nothing but the log-probabilities."""

    fields: ClassVar[tuple[str, ...]] = ("loss_scale",)
    needs: ClassVar[frozenset[str]] = frozenset()

    def __call__(self, inputs: TokenInputs) -> LossOutput:
        """`LossOutput` of the weighted token sum (``loss_scale`` cast to logps' dtype) and the
        supervised-token count."""
        mask = inputs.mask
        terms = -(inputs.fields["loss_scale"].to(inputs.logps.dtype) * inputs.logps)  # [B, T]
        # where, not a product: a non-finite value on an ignored token must not leak in
        return LossOutput(torch.where(mask, terms, 0.0).sum(), mask.sum())


def weighted_cross_entropy() -> WeightedCrossEntropy:
    """The `WeightedCrossEntropy` loss."""
    return WeightedCrossEntropy()
