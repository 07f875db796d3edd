"""GRPO's group-normalised advantages: each sample's reward against its group's."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

NORMALIZE = ("std", "none")


def group_advantages(
    rewards: Sequence[float] | Tensor,
    group_size: int,
    normalize: str = "std",
    eps: float = 1e-6,
) -> Tensor:
    """Advantages of `rewards` in consecutive groups of `group_size` (one prompt's samples).

    ``rewards``: ``[n]`` numbers, ``n`` a multiple of `group_size`, the samples of each prompt
    next to each other. Returns ``[n]`` float64: ``r - mean(group)``, divided by
    ``std(group) + eps`` (unbiased std, as GRPO and TRL) with ``normalize="std"``, or not with
    ``"none"`` (Dr. GRPO). A group whose rewards are all equal gets advantages 0: it carries no
    signal. Raises ``ValueError`` for rewards that are not a flat sequence of finite numbers,
    a `group_size` below 1 (below 2 with ``"std"``: one sample has no spread) or not dividing
    ``n``, an unknown `normalize`, or an `eps` that is not a finite number >= 0.
    """
    if normalize not in NORMALIZE:
        raise ValueError(
            f"group_advantages: normalize must be one of {NORMALIZE}, got {normalize!r}"
        )
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_advantages: group_size must be an int >= 1, got {group_size!r}")
    if normalize == "std" and group_size < 2:
        raise ValueError("group_advantages: normalize='std' needs group_size >= 2 (or 'none')")
    if (
        isinstance(eps, bool)
        or not isinstance(eps, int | float)
        or not math.isfinite(eps)
        or eps < 0
    ):
        raise ValueError(f"group_advantages: eps must be a finite number >= 0, got {eps!r}")
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if r.ndim != 1 or not bool(torch.isfinite(r).all()):
        raise ValueError(
            f"group_advantages: rewards must be a flat sequence of finite numbers, got shape "
            f"{tuple(r.shape)}"
        )
    if r.numel() == 0 or r.numel() % group_size:
        raise ValueError(
            f"group_advantages: {r.numel()} rewards do not split into groups of {group_size}; "
            "give every prompt group_size samples, next to each other"
        )
    groups = r.view(-1, group_size)  # [prompts, group_size]
    centred = groups - groups.mean(dim=1, keepdim=True)
    if normalize == "std":
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)
