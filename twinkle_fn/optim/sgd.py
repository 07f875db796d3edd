"""SGD with optional (Nesterov) momentum and L2 weight decay, matching ``torch.optim.SGD``."""

from __future__ import annotations

from typing import NamedTuple

import torch

from twinkle_fn.optim.base import (
    GradientTransformation,
    Params,
    Schedule,
    Updates,
    advance_counter,
    check_lr,
    check_nonnegative,
    foreach_groups,
    init_counter,
    lr_at,
    tensor_leaves_like,
)
from twinkle_fn.optim.masks import DecayMask, decay_targets, default_decay_mask, resolve_mask
from twinkle_fn.pytree import PyTree, tree_leaves, tree_map


class SGDState(NamedTuple):
    """SGD's state. `count` and `lr` are 0-d CPU tensors; `momentum` is shaped like the params,
    or ``None`` (no leaves) when momentum is off."""

    count: torch.Tensor  # int64: updates applied so far
    lr: torch.Tensor  # float64: the lr of the last update (0 before the first)
    momentum: PyTree  # momentum buffers, or None


def sgd(
    lr: float | Schedule,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    mask: DecayMask = default_decay_mask,
) -> GradientTransformation:
    """Stochastic gradient descent as a `GradientTransformation`, matching ``torch.optim.SGD``
    (dampening 0).

    `lr` is a float or a schedule called with the number of updates already applied. Weight decay
    is torch's coupled L2 term (``g <- g + weight_decay*p`` before momentum), applied only to the
    leaves selected by `mask` (``None`` decays everything). The momentum buffers start at zero,
    which gives torch's first step (buffer = gradient) exactly. Raises ``ValueError`` for an
    out-of-range hyper-parameter, or for `nesterov` without momentum.
    """
    lr = check_lr(lr)
    momentum = check_nonnegative("momentum", momentum)
    weight_decay = check_nonnegative("weight_decay", weight_decay)
    if nesterov and momentum == 0.0:
        raise ValueError("sgd: nesterov=True needs momentum > 0")

    def init(params: Params) -> SGDState:
        tensor_leaves_like(params, params, "params")
        if weight_decay:
            resolve_mask(mask, params)  # fail at init, not at the first step
        count, last_lr = init_counter()
        buffers = (
            tree_map(lambda p: torch.zeros_like(p, memory_format=torch.preserve_format), params)
            if momentum
            else None
        )
        return SGDState(count=count, lr=last_lr, momentum=buffers)

    def update(
        updates: Updates, state: SGDState, params: Params = None
    ) -> tuple[Updates, SGDState]:
        # The state holds no per-parameter tree without momentum: check against the params then.
        reference = state.momentum if momentum else (updates if params is None else params)
        g = tensor_leaves_like(updates, reference, "updates")
        bufs = tree_leaves(state.momentum) if momentum else []
        step_lr = lr_at(lr, state.count)
        decay, p = decay_targets(mask, params, reference, "sgd") if weight_decay else ([], [])
        with torch.no_grad():
            for idx in foreach_groups(g):
                gs = [g[i] for i in idx]
                if decayed := [i for i in idx if decay and decay[i]]:
                    torch._foreach_add_(
                        [g[i] for i in decayed], [p[i] for i in decayed], alpha=weight_decay
                    )
                if not momentum:
                    torch._foreach_mul_(gs, -step_lr)
                    continue
                bs = [bufs[i] for i in idx]
                torch._foreach_mul_(bs, momentum)
                torch._foreach_add_(bs, gs)
                if nesterov:
                    torch._foreach_add_(gs, bs, alpha=momentum)
                    torch._foreach_mul_(gs, -step_lr)
                else:
                    # zero + add rather than _foreach_copy_, which DTensor does not implement.
                    torch._foreach_zero_(gs)
                    torch._foreach_add_(gs, bs, alpha=-step_lr)
        advance_counter(state.count, state.lr, step_lr)
        return updates, SGDState(state.count, state.lr, state.momentum)

    def next_lr(state: SGDState) -> float:
        return lr_at(lr, state.count)

    return GradientTransformation(init, update, next_lr)
