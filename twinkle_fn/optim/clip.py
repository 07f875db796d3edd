"""Gradient clipping by global norm, matching ``torch.nn.utils.clip_grad_norm_``."""

from __future__ import annotations

import torch

from twinkle_fn.optim.base import (
    EmptyState,
    GradientTransformation,
    Params,
    ScaledUpdates,
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
    sync. Takes a `ScaledUpdates` (``takes_scaled``): its norm is the tree's (measured unless
    given) times the pending scale, and the clip factor joins that scale instead of a pass over
    the updates. Stateless: its state is an `EmptyState`. Raises ``ValueError`` unless
    `max_norm` is a finite number > 0.
    """
    max_norm = check_nonnegative("max_norm", max_norm)
    if max_norm == 0.0:
        raise ValueError("max_norm must be > 0, got 0.0")

    def factor(norm: torch.Tensor) -> torch.Tensor:
        return torch.clamp(max_norm / (norm + _NORM_EPS), max=1.0)

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(
        updates: Updates | ScaledUpdates, state: EmptyState, params: Params = None
    ) -> tuple[Updates | ScaledUpdates, EmptyState]:
        if isinstance(updates, ScaledUpdates):
            tree, scale, norm = updates.tree, updates.scale, updates.norm
            tensor_leaves_like(tree, tree, "updates")
            norm = tree_global_norm(tree) if norm is None else norm
            return ScaledUpdates(tree, scale * factor(norm * scale), norm), state
        leaves = tensor_leaves_like(updates, updates, "updates")
        foreach_mul_(leaves, factor(tree_global_norm(updates)))
        return updates, state

    return GradientTransformation(init, update, takes_scaled=True)
