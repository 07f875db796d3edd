"""Gradient clipping by global norm, matching ``torch.nn.utils.clip_grad_norm_``."""

from __future__ import annotations

import torch

from twinkle_fn.optim.base import (
    EmptyState,
    GradientTransformation,
    Params,
    Updates,
    check_nonnegative,
    foreach_mul_,
    tensor_leaves_like,
)
from twinkle_fn.pytree import tree_global_norm

_NORM_EPS = 1e-6  # torch's clip_grad_norm_ guard against a zero norm


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all updates in place by ``min(1, max_norm / (norm + 1e-6))``, where `norm` is the
    L2 norm of every leaf taken as one vector (`tree_global_norm`).

    The scale stays a device tensor (no Python branch on the norm), so the step needs no host
    sync. Stateless: its state is an `EmptyState`. Raises ``ValueError`` unless `max_norm` is a
    finite number > 0.
    """
    max_norm = check_nonnegative("max_norm", max_norm)
    if max_norm == 0.0:
        raise ValueError("max_norm must be > 0, got 0.0")

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(
        updates: Updates, state: EmptyState, params: Params = None
    ) -> tuple[Updates, EmptyState]:
        leaves = tensor_leaves_like(updates, updates, "updates")
        norm = tree_global_norm(updates)
        scale = torch.clamp(max_norm / (norm + _NORM_EPS), max=1.0)
        foreach_mul_(leaves, scale)
        return updates, state

    return GradientTransformation(init, update)
