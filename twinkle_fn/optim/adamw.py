"""AdamW with decoupled weight decay: one fused Triton kernel per dtype on CUDA, torch's
multi-tensor (``_foreach``) kernels elsewhere.

Two paths compute the same update into the gradient buffers (``apply_updates`` then adds it):

- foreach (CPU, float64, non-contiguous tensors, no triton, ``fused=False``): ``torch.optim.AdamW``'s
  foreach kernels in the same order. With no weight decay the parameters match torch's bit for bit
  (checked on CPU); with weight decay they differ by the rounding of applying the decay as part of
  the update (``p + (u - lr*wd*p)`` instead of torch's ``p*(1 - lr*wd) + u``), a few ulps after
  several steps. About 100 bytes of memory traffic per float32 element.
- fused (CUDA tensors of float32/bf16/fp16 when triton imports; `_adamw_kernel`): one pass that
  reads g, m, v (and p where decayed) and writes m, v, u: 28 bytes per float32 element. In float32
  it repeats the foreach path's operations and roundings (IEEE sqrt and division, the same fused
  multiply-adds), so the two agree to within an ulp or two, and so with torch. bf16/fp16 tensors
  are computed in float32 and rounded once when stored (like torch's ``fused=True`` AdamW), where
  the foreach path rounds each intermediate to the tensor dtype: they differ by a few bf16 ulps.

Sharded tensors (FSDP2 / replicated DTensors) are updated through their local shards whenever the
gradient, moments and parameter of a leaf share one placement with no Partial (`local_operands`):
the math is elementwise, so the result is the unsharded step's, bit for bit, without DTensor's
per-op dispatch. Other leaves (a Partial gradient) take the foreach path on DTensors.

The moments are kept in the dtype of the parameters, as torch does: for bf16 training keep fp32
master weights (Megatron's distributed optimizer does) rather than bf16 params with bf16 moments.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor

from twinkle_fn import _triton
from twinkle_fn.optim.base import (
    GradientTransformation,
    Params,
    ScaledUpdates,
    Schedule,
    Updates,
    advance_counter,
    check_lr,
    check_nonnegative,
    foreach_groups,
    foreach_mul_,
    init_counter,
    local_operands,
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
    fused: bool = True,
) -> GradientTransformation:
    """AdamW (Loshchilov & Hutter) as a `GradientTransformation`, matching ``torch.optim.AdamW``.

    `lr` is a float or a schedule called with the number of updates already applied (the first
    update uses ``lr(0)``). Weight decay ``p <- p - lr*weight_decay*p`` applies only to the leaves
    selected by `mask` (see `resolve_mask`; ``None`` decays everything); it needs the params to be
    passed to ``update``. `fused` lets CUDA tensors take the one-pass Triton kernel (see the
    module docstring); ``False`` keeps every tensor on torch's foreach kernels. Takes a
    `ScaledUpdates` (``takes_scaled``): the kernel multiplies each gradient by the pending scale
    as it reads it (in float32 within an ulp of multiplying first), the foreach path multiplies
    first. Raises ``ValueError`` for an out-of-range hyper-parameter.
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
        updates: Updates | ScaledUpdates, state: AdamWState, params: Params = None
    ) -> tuple[Updates, AdamWState]:
        scale = None
        if isinstance(updates, ScaledUpdates):
            updates, scale = updates.tree, updates.scale
        g = tensor_leaves_like(updates, state.mu, "updates")
        mu, nu = tree_leaves(state.mu), tree_leaves(state.nu)
        step_lr = lr_at(lr, state.count)
        t = int(state.count) + 1
        step = AdamWStep.at(step_lr, t, b1, b2, eps, weight_decay)
        p: list[torch.Tensor | None] = [None] * len(g)
        if weight_decay:
            decay, leaves = decay_targets(mask, params, state.mu, "adamw")
            p = [leaf if flag else None for leaf, flag in zip(leaves, decay, strict=True)]
        g, mu, nu, p = local_operands(g, mu, nu, p)
        with torch.no_grad():
            for idx in foreach_groups(g):
                if fused and _kernel_applies(g[idx[0]]):
                    takes = [_kernel_takes(g[i], mu[i], nu[i], p[i]) for i in idx]
                    kernel_idx = list(itertools.compress(idx, takes))
                    _kernel_step(*_pick(kernel_idx, g, mu, nu, p), step, scale)
                    idx = [i for i, took in zip(idx, takes, strict=True) if not took]
                if idx:
                    if scale is not None:
                        foreach_mul_([g[i] for i in idx], scale)
                    _foreach_step(*_pick(idx, g, mu, nu, p), step)
        advance_counter(state.count, state.lr, step_lr)
        return updates, AdamWState(state.count, state.lr, state.mu, state.nu)

    def next_lr(state: AdamWState) -> float:
        return lr_at(lr, state.count)

    return GradientTransformation(init, update, next_lr, takes_scaled=True)


class AdamWStep(NamedTuple):
    """One AdamW update's host-side scalars (float64 here; the kernels round them to float32),
    shared by `adamw` and `twinkle_fn.optim.adamw_bf16`."""

    b1: float
    b2: float
    eps: float
    step_size: float  # -lr / (1 - b1**t)
    bc2_sqrt: float  # sqrt(1 - b2**t)
    decay_scale: float  # -lr * weight_decay

    @classmethod
    def at(
        cls, lr: float, t: int, b1: float, b2: float, eps: float, weight_decay: float
    ) -> AdamWStep:
        """The scalars of update `t` (1 for the first) at learning rate `lr`."""
        return cls(b1, b2, eps, -(lr / (1 - b1**t)), (1 - b2**t) ** 0.5, -lr * weight_decay)


def _pick(idx: list[int], *columns: list) -> list[list]:
    return [[column[i] for i in idx] for column in columns]


def _foreach_step(
    gs: list[torch.Tensor],
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    ps: list[torch.Tensor | None],
    step: AdamWStep,
) -> None:
    """The step on one foreach group (one type, device, dtype), as ``torch.optim.AdamW(foreach=True)``
    computes it: the reference for the kernel and the path everywhere it does not run."""
    torch._foreach_lerp_(ms, gs, 1 - step.b1)
    torch._foreach_mul_(vs, step.b2)
    torch._foreach_addcmul_(vs, gs, gs, 1 - step.b2)
    denom = torch._foreach_sqrt(vs)
    torch._foreach_div_(denom, step.bc2_sqrt)
    torch._foreach_add_(denom, step.eps)
    # Writing the step into the zeroed gradient buffer keeps the kernel (and so the rounding) of
    # torch's `param.addcdiv_(exp_avg, denom, -step_size)`.
    torch._foreach_zero_(gs)
    torch._foreach_addcdiv_(gs, ms, denom, step.step_size)
    if decayed := [i for i, p in enumerate(ps) if p is not None]:
        torch._foreach_add_(
            [gs[i] for i in decayed], [ps[i] for i in decayed], alpha=step.decay_scale
        )


def _kernel_applies(t: torch.Tensor) -> bool:
    """Whether the fused Triton kernel can run on `t`'s foreach group: a plain (or local) CUDA
    tensor of a kernel dtype, with triton importable."""
    if isinstance(t, DTensor) or t.device.type != "cuda":
        return False
    if not _triton.available():
        return False
    from twinkle_fn.optim import _adamw_kernel  # imports triton: only paid on CUDA

    return t.dtype in _adamw_kernel.KERNEL_DTYPES


def _kernel_takes(*operands: torch.Tensor | None) -> bool:
    """Whether the kernel can take one leaf: it indexes flat memory, so every operand must be
    contiguous, and all share the gradient's dtype."""
    dtype = operands[0].dtype
    return all(t is None or (t.is_contiguous() and t.dtype == dtype) for t in operands)


def _kernel_step(
    gs: list[torch.Tensor],
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    ps: list[torch.Tensor | None],
    step: AdamWStep,
    scale: torch.Tensor | None,
) -> None:
    from twinkle_fn.optim import _adamw_kernel

    if not gs:
        return
    _adamw_kernel.adamw_step_(
        gs,
        ms,
        vs,
        ps,
        b1=step.b1,
        b2=step.b2,
        eps=step.eps,
        step_size=step.step_size,
        bc2_sqrt=step.bc2_sqrt,
        decay_scale=step.decay_scale,
        grad_scale=None if scale is None else scale.to(gs[0].device, torch.float32),
    )
