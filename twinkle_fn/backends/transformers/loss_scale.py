"""Dynamic loss scaling for float16 compute (what ``torch.amp.GradScaler`` does, as data).

float16 gradients underflow, so the loss is multiplied by a large scale before backward and the
gradients are divided by it before the update. A step whose gradients overflowed is skipped and
the scale halves; after `growth_interval` good steps in a row it doubles. The scale lives in the
train state (a CPU tensor: reading it needs no device sync), so checkpoints carry it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

GROWTH_INTERVAL = 2000


class LossScale(NamedTuple):
    """``scale`` (0-d float64) and ``good_steps`` (0-d int64, updates since the last change)."""

    scale: torch.Tensor
    good_steps: torch.Tensor


def init_loss_scale(scale: float = 2.0**16) -> LossScale:
    """A fresh loss scale. Raises ``ValueError`` unless `scale` is a positive finite number."""
    if not (isinstance(scale, int | float) and 0 < scale < float("inf")):
        raise ValueError(f"loss scale must be a positive finite number, got {scale!r}")
    return LossScale(
        torch.tensor(float(scale), dtype=torch.float64), torch.zeros((), dtype=torch.int64)
    )


def next_loss_scale(
    ls: LossScale, finite: bool, growth_interval: int = GROWTH_INTERVAL
) -> LossScale:
    """The scale after a step whose gradients were `finite` (kept or doubled) or not (halved)."""
    if not finite:
        return LossScale(ls.scale / 2, torch.zeros_like(ls.good_steps))
    good = ls.good_steps + 1
    if int(good) >= growth_interval:
        return LossScale(ls.scale * 2, torch.zeros_like(good))
    return LossScale(ls.scale.clone(), good)
