"""AdamW with decoupled weight decay, on torch's multi-tensor (``_foreach``) kernels.

Numerically this is ``torch.optim.AdamW`` (amsgrad off): the same kernels in the same order. With
no weight decay the parameters match torch's bit for bit (checked on CPU); with weight decay they
differ by the rounding of applying the decay as part of the update (``p + (u - lr*wd*p)`` instead of
torch's ``p*(1 - lr*wd) + u``), a few ulps after several steps.

The moments are kept in the dtype of the parameters, as torch does: for bf16 training keep fp32
master weights (Megatron's distributed optimizer does) rather than bf16 params with bf16 moments.
"""

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


class AdamWState(NamedTuple):
    """AdamW's state. `count` and `lr` are 0-d CPU tensors, `mu` and `nu` are shaped like the
    params (same dtype and device)."""

    count: torch.Tensor  # int64: updates applied so far
    lr: torch.Tensor  # float64: the lr of the last update (0 before the first)
    mu: PyTree  # first moment (EMA of the gradients)
    nu: PyTree  # second moment (EMA of the squared gradients)


def adamw(
    lr: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    mask: DecayMask = default_decay_mask,
) -> GradientTransformation:
    """AdamW (Loshchilov & Hutter) as a `GradientTransformation`, matching ``torch.optim.AdamW``.

    `lr` is a float or a schedule called with the number of updates already applied (the first
    update uses ``lr(0)``). Weight decay ``p <- p - lr*weight_decay*p`` applies only to the leaves
    selected by `mask` (see `resolve_mask`; ``None`` decays everything); it needs the params to be
    passed to ``update``. Raises ``ValueError`` for an out-of-range hyper-parameter.
    """
    lr = check_lr(lr)
    b1 = check_nonnegative("b1", b1, below_one=True)
    b2 = check_nonnegative("b2", b2, below_one=True)
    eps = check_nonnegative("eps", eps)
    weight_decay = check_nonnegative("weight_decay", weight_decay)

    def init(params: Params) -> AdamWState:
        tensor_leaves_like(params, params, "params")
        if weight_decay:
            resolve_mask(mask, params)  # fail at init, not at the first step
        count, last_lr = init_counter()
        zeros = tree_map(lambda p: torch.zeros_like(p, memory_format=torch.preserve_format), params)
        return AdamWState(count=count, lr=last_lr, mu=zeros, nu=tree_map(torch.zeros_like, zeros))

    def update(
        updates: Updates, state: AdamWState, params: Params = None
    ) -> tuple[Updates, AdamWState]:
        g = tensor_leaves_like(updates, state.mu, "updates")
        mu, nu = tree_leaves(state.mu), tree_leaves(state.nu)
        step_lr = lr_at(lr, state.count)
        t = int(state.count) + 1
        bias_correction1 = 1 - b1**t
        bias_correction2_sqrt = (1 - b2**t) ** 0.5
        decay, p = decay_targets(mask, params, state.mu, "adamw") if weight_decay else ([], [])
        with torch.no_grad():
            for idx in foreach_groups(g):
                gs, ms, vs = [g[i] for i in idx], [mu[i] for i in idx], [nu[i] for i in idx]
                torch._foreach_lerp_(ms, gs, 1 - b1)
                torch._foreach_mul_(vs, b2)
                torch._foreach_addcmul_(vs, gs, gs, 1 - b2)
                denom = torch._foreach_sqrt(vs)
                torch._foreach_div_(denom, bias_correction2_sqrt)
                torch._foreach_add_(denom, eps)
                # Writing the step into the zeroed gradient buffer keeps the kernel (and so the
                # rounding) of torch's `param.addcdiv_(exp_avg, denom, -step_size)`.
                torch._foreach_zero_(gs)
                torch._foreach_addcdiv_(gs, ms, denom, -(step_lr / bias_correction1))
                if decayed := [i for i in idx if decay and decay[i]]:
                    torch._foreach_add_(
                        [g[i] for i in decayed],
                        [p[i] for i in decayed],
                        alpha=-step_lr * weight_decay,
                    )
        advance_counter(state.count, state.lr, step_lr)
        return updates, AdamWState(state.count, state.lr, state.mu, state.nu)

    return GradientTransformation(init, update)
