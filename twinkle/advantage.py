"""Upstream Twinkle's advantage functions: ``GRPOAdvantage()(rewards, num_generations, scale)``.

Both centre each prompt's rewards through the core's `twinkle_fn.losses.group_advantages`
(``num_generations`` samples of one prompt next to each other):

- `GRPOAdvantage`: ``r - mean(group)``; ``scale='group'`` divides by the group's std,
  ``'batch'`` by the std of every reward, ``'none'`` by nothing. With ``num_generations=1``
  ``'group'`` returns the rewards unchanged and ``'batch'`` / ``'none'`` centre on the batch
  mean (upstream's rules).
- `RLOOAdvantage`: ``r - mean(the other K - 1 rewards of the group)``, which is
  ``K / (K - 1) * (r - mean(group))``, scaled as above.

As upstream: the std is the unbiased one plus ``1e-8``; rewards ``[n, k]`` are summed over
their last dim first; the result is ``[n]`` in the rewards' dtype (float32 for a list).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from twinkle_fn.losses import group_advantages

Scale = Literal["group", "batch", "none"]
SCALES = ("group", "batch", "none")
EPS = 1e-8  # upstream's


class Advantage:
    """Upstream's base: ``advantage(rewards, num_generations=1, scale='group') -> [n]``."""

    def __call__(
        self,
        rewards: Tensor | Sequence[float],
        num_generations: int = 1,
        scale: Scale = "group",
        **kwargs: object,
    ) -> Tensor:
        """The advantages of `rewards`; see the subclasses."""
        raise NotImplementedError


class GRPOAdvantage(Advantage):
    """GRPO's group-relative advantages (module docstring)."""

    def __call__(
        self,
        rewards: Tensor | Sequence[float],
        num_generations: int = 1,
        scale: Scale = "group",
        **kwargs: object,
    ) -> Tensor:
        """``[n]`` advantages of `rewards` ``[n]`` (or ``[n, k]``, summed over k).

        Raises ``ValueError`` for an unknown `scale`, a `num_generations` below 1 or not
        dividing ``n``, and rewards that are not finite numbers.
        """
        r = _rewards(rewards, num_generations, scale, minimum=1)
        n = r.numel()
        if num_generations == 1:
            if scale == "group":
                return r
            num_generations = n  # one group: the batch
            if n == 1:
                return torch.zeros_like(r)  # one reward has no spread
        if scale == "batch":
            centred = group_advantages(r, num_generations, normalize="none")
            return (centred / (r.double().std() + EPS)).to(r.dtype)
        normalize = "std" if scale == "group" else "none"
        return group_advantages(r, num_generations, normalize=normalize, eps=EPS).to(r.dtype)


class RLOOAdvantage(Advantage):
    """REINFORCE leave-one-out advantages (module docstring)."""

    def __call__(
        self,
        rewards: Tensor | Sequence[float],
        num_generations: int = 1,
        scale: Scale = "group",
        **kwargs: object,
    ) -> Tensor:
        """``[n]`` advantages of `rewards` ``[n]`` (or ``[n, k]``, summed over k).

        Raises ``ValueError`` for an unknown `scale`, a `num_generations` below 2 (one sample
        has no others to compare with) or not dividing ``n``, and non-finite rewards.
        """
        r = _rewards(rewards, num_generations, scale, minimum=2)
        k = num_generations
        if scale == "batch":
            centred = group_advantages(r, k, normalize="none") / (r.double().std() + EPS)
        else:
            normalize = "std" if scale == "group" else "none"
            centred = group_advantages(r, k, normalize=normalize, eps=EPS)
        # leave-one-out: r - (sum - r) / (k - 1) = k / (k - 1) * (r - mean)
        return (centred * (k / (k - 1))).to(r.dtype)


def _rewards(
    rewards: Tensor | Sequence[float], num_generations: int, scale: str, minimum: int
) -> Tensor:
    """`rewards` as a flat float tensor (float32 from a list), checked against the call."""
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    r = rewards if isinstance(rewards, Tensor) else torch.tensor(rewards, dtype=torch.float32)
    if not r.dtype.is_floating_point:
        r = r.float()
    if r.dim() > 1:
        r = r.sum(dim=-1)  # several reward functions: their sum, as upstream
    valid = not isinstance(num_generations, bool) and isinstance(num_generations, int)
    if not valid or num_generations < minimum or r.numel() % num_generations:
        raise ValueError(
            f"num_generations={num_generations!r} must be an int >= {minimum} dividing the "
            f"{r.numel()} rewards (each prompt's samples next to each other)"
        )
    return r.reshape(-1)
