"""Muon: momentum orthogonalised by a Newton–Schulz iteration, matching ``torch.optim.Muon``.

Per matrix parameter ``p`` with gradient ``g`` and momentum buffer ``b`` (zero at first)::

    b <- lerp(b, g, 1 - momentum)                  # b = momentum * b + (1 - momentum) * g
    u <- lerp(g, b, momentum) if nesterov else b
    O <- NS(u)                                      # ~ U V^T of u = U S V^T, in bfloat16
    p <- p - lr * weight_decay * p - adjusted_lr * O

``NS`` is torch's quintic Newton–Schulz iteration (coefficients ``(a, b, c)``, `ns_steps`
iterations on the normalised matrix, its wide orientation), run in bfloat16 as torch runs it.
``adjusted_lr`` scales `lr` by the matrix shape ``[A, B]``: ``sqrt(max(1, A / B))``
(``adjust_lr_fn=None`` or ``'original'``, Keller Jordan's) or ``0.2 * sqrt(max(A, B))``
(``'match_rms_adamw'``, Moonshot's: the update's RMS of AdamW's, so AdamW's lr and decay carry
over). Weight decay is decoupled and applies to the leaves `mask` selects.

A sharded parameter (a DTensor) is orthogonalised whole: every rank gathers the matrix, runs
the iteration on it and keeps its own shard of the result, so any mesh gives the update of one
process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor, Replicate

from twinkle_fn.optim.base import (
    GradientTransformation,
    Params,
    Schedule,
    Updates,
    advance_counter,
    check_lr,
    check_nonnegative,
    init_counter,
    local_operands,
    lr_at,
    tensor_leaves_like,
)
from twinkle_fn.optim.masks import DecayMask, decay_targets, default_decay_mask, resolve_mask
from twinkle_fn.pytree import PyTree, tree_flatten_with_path, tree_leaves, tree_map

# torch.optim.Muon's defaults (Keller Jordan's coefficients)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
EPS = 1e-7
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


class MuonState(NamedTuple):
    """Muon's state: `count` and `lr` are 0-d CPU tensors; `momentum` is shaped like the
    params."""

    count: torch.Tensor  # int64: updates applied so far
    lr: torch.Tensor  # float64: the lr of the last update (0 before the first)
    momentum: PyTree  # momentum buffers


def newton_schulz(
    matrix: torch.Tensor,  # [A, B]
    coefficients: Sequence[float] = NS_COEFFICIENTS,
    steps: int = NS_STEPS,
    eps: float = EPS,
) -> torch.Tensor:  # [A, B] bfloat16
    """The approximate orthogonalisation ``U S' V^T`` (``S'`` near 1) of `matrix` = ``U S
    V^T``: `steps` quintic Newton–Schulz iterations in bfloat16 on ``matrix / ||matrix||_F``
    (its transpose when taller than wide), as ``torch.optim.Muon``. Raises ``ValueError`` for
    a tensor that is not 2-D."""
    if matrix.dim() != 2:
        raise ValueError(f"newton_schulz needs a 2-D matrix, got shape {tuple(matrix.shape)}")
    a, b, c = coefficients
    x = matrix.bfloat16()
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """`lr` scaled for a matrix of `shape` ``[A, B]``: ``sqrt(max(1, A / B))`` (None or
    ``'original'``) or ``0.2 * sqrt(max(A, B))`` (``'match_rms_adamw'``)."""
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1.0, rows / cols))


def muon(
    lr: float | Schedule,
    momentum: float = 0.95,
    nesterov: bool = True,
    weight_decay: float = 0.0,
    ns_coefficients: Sequence[float] = NS_COEFFICIENTS,
    ns_steps: int = NS_STEPS,
    eps: float = EPS,
    adjust_lr_fn: str | None = None,
    mask: DecayMask = default_decay_mask,
) -> GradientTransformation:
    """Muon as a `GradientTransformation`, matching ``torch.optim.Muon`` step for step (see
    the module docstring). Every parameter must be a matrix (``torch.optim.Muon`` refuses
    others too): train biases and norms with `adamw`.

    `lr` is a float or a schedule of the number of updates already applied; `mask` selects
    the leaves that get weight decay (``None``: all). Raises ``ValueError`` for an
    out-of-range hyper-parameter or an unknown `adjust_lr_fn`, and (from ``init``) for a
    parameter that is not 2-D, naming it.
    """
    lr = check_lr(lr)
    momentum = check_nonnegative("momentum", momentum)
    weight_decay = check_nonnegative("weight_decay", weight_decay)
    eps = check_nonnegative("eps", eps)
    if adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(f"muon: adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or not 0 < ns_steps < 100:
        raise ValueError(f"muon: ns_steps must be an int in [1, 99], got {ns_steps!r}")
    if len(ns_coefficients) != 3:
        raise ValueError(f"muon: ns_coefficients must be 3 numbers, got {ns_coefficients!r}")
    coefficients = tuple(float(v) for v in ns_coefficients)

    def init(params: Params) -> MuonState:
        tensor_leaves_like(params, params, "params")
        for path, leaf in tree_flatten_with_path(params):
            if leaf.dim() != 2:
                raise ValueError(
                    f"muon orthogonalises matrices, and parameter {path!r} has shape "
                    f"{tuple(leaf.shape)}; train only matrices with it (e.g. LoRA adapters), "
                    "or use adamw"
                )
        if weight_decay:
            resolve_mask(mask, params)  # fail at init, not at the first step
        count, last_lr = init_counter()
        buffers = tree_map(lambda p: torch.zeros_like(p), params)
        return MuonState(count=count, lr=last_lr, momentum=buffers)

    def update(
        updates: Updates, state: MuonState, params: Params = None
    ) -> tuple[Updates, MuonState]:
        whole = tensor_leaves_like(updates, state.momentum, "updates")
        bufs = tree_leaves(state.momentum)
        step_lr = lr_at(lr, state.count)
        decay, p = decay_targets(mask, params, state.momentum, "muon") if weight_decay else ([], [])
        columns = [whole, bufs, p] if p else [whole, bufs]
        local = local_operands(*columns)
        with torch.no_grad():
            for i, leaf in enumerate(whole):
                g, buf = local[0][i], local[1][i]
                buf.lerp_(g, 1 - momentum)
                u = g.lerp(buf, momentum) if nesterov else buf
                ortho = _orthogonal(u, leaf, coefficients, ns_steps, eps)
                scale = adjusted_lr(step_lr, adjust_lr_fn, leaf.shape)
                if decay and decay[i]:
                    g.copy_(local[2][i])
                    g.mul_(-step_lr * weight_decay)
                else:
                    g.zero_()
                g.add_(ortho, alpha=-scale)
        advance_counter(state.count, state.lr, step_lr)
        return updates, MuonState(state.count, state.lr, state.momentum)

    def next_lr(state: MuonState) -> float:
        return lr_at(lr, state.count)

    return GradientTransformation(init, update, next_lr)


def _orthogonal(
    u: torch.Tensor, leaf: torch.Tensor, coefficients: Sequence[float], steps: int, eps: float
) -> torch.Tensor:
    """`newton_schulz` of the whole matrix `u` is part of, laid out as `u` (this rank's shard
    when `leaf`, the gradient the update is written into, is a DTensor)."""
    if not isinstance(leaf, DTensor):
        return newton_schulz(u, coefficients, steps, eps)
    if isinstance(u, DTensor):
        full = u.full_tensor()
    else:  # a local shard of `leaf`'s layout (`local_operands`)
        full = DTensor.from_local(
            u, leaf.device_mesh, leaf.placements, shape=leaf.shape, stride=leaf.stride()
        ).full_tensor()
    ortho = newton_schulz(full, coefficients, steps, eps)
    mesh = leaf.device_mesh
    replicated = DTensor.from_local(ortho, mesh, [Replicate()] * mesh.ndim, run_check=False)
    placements = u.placements if isinstance(u, DTensor) else leaf.placements
    sharded = replicated.redistribute(mesh, placements)
    return sharded if isinstance(u, DTensor) else sharded.to_local()
