"""PPO's clipped value loss for a critic, as a `TokenLoss` over a value head's per-token values.

Per supervised token ``t``, with the critic's value ``V_t``, the rollout's value ``V_old_t``
(batch field ``old_values``, e.g. from ``tf.token_values`` before the update) and the return
``R_t`` (batch field ``returns``, e.g. GAE advantages plus ``V_old``)::

    0.5 * max((V_t - R_t)^2, (clip(V_t, V_old_t - c, V_old_t + c) - R_t)^2)

counting the supervised tokens, so ``tf.step`` takes the mean over every supervised token of the
step (verl's ``compute_value_loss`` with token-mean aggregation). The max keeps the larger
error: the clip can only slow a value that moves further than ``c`` from its rollout value in
a direction that helps, never speed it up. ``clip=None`` is the plain ``0.5 * (V - R)^2``,
which reads no ``old_values``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from twinkle_fn.losses.cross_entropy import LossOutput
from twinkle_fn.losses.token_loss import TokenInputs


@dataclass(frozen=True)
class ValueLoss:
    """The loss of the module docstring (build it with `value_loss`). Needs ``values``."""

    clip: float | None = 0.2
    needs: ClassVar[frozenset[str]] = frozenset({"values"})

    @property
    def fields(self) -> tuple[str, ...]:
        """``("returns", "old_values")``, or ``("returns",)`` without a clip."""
        return ("returns",) if self.clip is None else ("returns", "old_values")

    def __call__(self, inputs: TokenInputs) -> LossOutput:
        """`LossOutput` of the token-summed loss over `inputs`' supervised tokens (fields cast
        to the values' dtype) and their count."""
        values = inputs.values  # [B, T]
        returns = inputs.fields["returns"].to(values.dtype)
        error = (values - returns).square()
        if self.clip is not None:
            old = inputs.fields["old_values"].to(values.dtype)
            clipped = torch.clamp(values, old - self.clip, old + self.clip)
            error = torch.maximum(error, (clipped - returns).square())
        mask = inputs.mask
        # where, not a product: a non-finite value on an ignored token must not leak in
        return LossOutput(0.5 * torch.where(mask, error, 0.0).sum(), mask.sum())


def value_loss(clip: float | None = 0.2) -> ValueLoss:
    """The `ValueLoss` with clip range `clip` (None: unclipped). Raises ``ValueError`` for a
    `clip` that is not a positive finite number or None."""
    if clip is not None and (
        isinstance(clip, bool)
        or not isinstance(clip, int | float)
        or not (math.isfinite(clip) and clip > 0)
    ):
        raise ValueError(f"clip must be a positive number or None (no clipping), got {clip!r}")
    return ValueLoss(None if clip is None else float(clip))
