"""AdamW with bf16 moments and stochastically rounded bf16 updates: full fine-tuning at 8 bytes a
parameter (bf16 parameter, gradient and two moments) instead of 16 (float32 master, gradient and
moments).

Why this and not optimizer states offloaded to pinned CPU memory: a 4B model's float32 moments
are 32 GB; moving them to the GPU and back each step is 64 GB over PCIe (about 2.5 s at 25 GB/s
each way), where the whole forward and backward of a 8K-token step takes about 0.5 s on an H100,
so offloading would bound the step by the bus even when overlapped; stepping them on the CPU
instead is slower still (4B Adam updates on 16 cores). bf16 moments keep everything on the GPU,
and the update costs one more pass over memory than a float32 AdamW. What makes bf16 storage
train like float32 is the rounding: rounding ``p + u`` to the nearest bf16 drops every update
smaller than half an ulp of ``p`` (``|u| < |p| * 2**-9``, which late in training is most of them),
so the weights stall. Rounding *stochastically* (up with probability equal to the distance to the
lower neighbour, in ulps) is unbiased: ``E[SR(p + u)] = p + u``, so small updates accumulate in
expectation (Zamirai et al. 2020, "Revisiting BFloat16 Training"; the same rounding as torchao's
``bf16_stochastic_round``). The moments are rounded the same way.

Numerics per element, in float32 registers: ``m <- lerp(m, g, 1-b1)``,
``v <- b2*v + (1-b2)*g*g``, ``u <- -lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)``, minus
``lr*wd*p`` on decayed leaves, then ``p <- SR(p + u)`` for a bf16 parameter (a float32 one is
added to exactly), ``m <- SR(m)``, ``v <- SR(v)``. Stochastic rounding adds 16 random bits to the
float32 bit pattern and truncates them; the bits come from a generator seeded by (`seed`, the
update count), so a run is reproducible and a resumed checkpoint continues the same stream.

The transform applies its update to the parameters itself (the rounding needs the unrounded sum,
which ``apply_updates``' bf16 addition would round to nearest) and returns the gradient buffers
zeroed, so that ``apply_updates`` then changes nothing: pass the parameters to ``update``.
Parameters are stored in bf16 by the backend: on the megatron backend under ``precision="bf16"``
(the model's own parameters, through the backend's generic optimizer path; megatron-core's
``DistributedOptimizer`` keeps float32 main parameters and moments and is not used by this
transform), on the transformers backend with ``options={"master_weights": False}``. On CUDA each
tensor is one pass of a Triton kernel (`_adamw_bf16_kernel`: 16 bytes of memory traffic a bf16
element); elsewhere (the CPU reference) torch ops run on chunks of `CHUNK` elements, so that
their float32 temporaries stay small (about 6 float32 copies of one chunk).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor

from twinkle_fn import _triton
from twinkle_fn.optim.adamw import AdamWStep
from twinkle_fn.optim.base import (
    GradientTransformation,
    Params,
    ScaledUpdates,
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
from twinkle_fn.pytree import PyTree, tree_leaves, tree_map

CHUNK = 1 << 24  # elements per chunk: 64 MiB per float32 temporary
_LOW_BITS = 1 << 16  # the float32 mantissa bits a bf16 drops
_HIGH_MASK = -(1 << 16)  # int32 0xFFFF0000


class AdamWBf16State(NamedTuple):
    """`adamw_bf16`'s state: `count` (int64) and `lr` (float64, of the last update) are 0-d CPU
    tensors; `mu` and `nu` are bf16 tensors shaped and placed like the params."""

    count: torch.Tensor
    lr: torch.Tensor
    mu: PyTree
    nu: PyTree


def adamw_bf16(
    lr: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    mask: DecayMask = default_decay_mask,
    seed: int = 0,
) -> GradientTransformation:
    """AdamW (as `twinkle_fn.optim.adamw`) with bf16 moments and stochastically rounded bf16
    parameter and moment updates; see the module docstring for the numerics and the memory.

    `lr` is a float or a schedule of the number of updates applied; weight decay applies to the
    leaves `mask` selects. `seed` (an int in [0, 2**62)) seeds the rounding's random bits with
    the update count. ``update`` writes the parameters in place and returns zeroed updates; it
    needs `params`. Gradients may be bf16 or float32 (a megatron grad buffer), and may come as
    a `ScaledUpdates` (``takes_scaled``): their pending factor is multiplied in, in float32, as
    each gradient is read. Raises
    ``ValueError`` for an out-of-range hyper-parameter or seed, from ``init`` for parameters
    neither bfloat16 nor float32, and from ``update`` without params.
    """
    lr = check_lr(lr)
    b1 = check_nonnegative("b1", b1, below_one=True)
    b2 = check_nonnegative("b2", b2, below_one=True)
    eps = check_nonnegative("eps", eps)
    weight_decay = check_nonnegative("weight_decay", weight_decay)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 62:
        raise ValueError(f"seed must be an int in [0, 2**62), got {seed!r}")

    def init(params: Params) -> AdamWBf16State:
        for i, p in enumerate(tensor_leaves_like(params, params, "params")):
            if p.dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(
                    f"adamw_bf16: parameter leaf {i} is {p.dtype}; it updates bfloat16 (or "
                    "float32) parameters: build the model with precision='bf16'"
                )
        if weight_decay:
            resolve_mask(mask, params)
        count, last_lr = init_counter()

        def zeros(p: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)

        return AdamWBf16State(count, last_lr, tree_map(zeros, params), tree_map(zeros, params))

    def update(
        updates: Updates | ScaledUpdates, state: AdamWBf16State, params: Params = None
    ) -> tuple[Updates, AdamWBf16State]:
        scale = None
        if isinstance(updates, ScaledUpdates):  # cast once, not once a leaf
            updates, scale = updates.tree, updates.scale.to(torch.float32)
        if params is None:
            raise ValueError(
                "adamw_bf16 writes the parameters itself (stochastic rounding needs the "
                "unrounded sum): pass them to update(updates, state, params)"
            )
        g = tensor_leaves_like(updates, state.mu, "updates")
        p = tensor_leaves_like(params, state.mu, "params")
        mu, nu = tree_leaves(state.mu), tree_leaves(state.nu)
        decay = decay_targets(mask, params, state.mu, "adamw_bf16")[0] if weight_decay else None
        step_lr = lr_at(lr, state.count)
        t = int(state.count) + 1
        step = AdamWStep.at(step_lr, t, b1, b2, eps, weight_decay)
        g, mu, nu, p = local_operands(g, mu, nu, p)
        generators: dict[torch.device, torch.Generator] = {}
        with torch.no_grad():
            for i, (gi, mi, vi, pi) in enumerate(zip(g, mu, nu, p, strict=True)):
                if isinstance(pi, DTensor):
                    raise ValueError(
                        f"adamw_bf16: leaf {i}'s gradient, moments and parameter are not laid out "
                        "alike (a partial gradient); reduce it before the update"
                    )
                decayed = bool(decay[i]) if decay is not None else False
                if _kernel_applies(gi, pi):
                    _kernel_step(gi, mi, vi, pi, step, decayed, _mix(seed, t) + i, scale)
                    continue
                gen = generators.get(pi.device)
                if gen is None:
                    gen = generators[pi.device] = torch.Generator(pi.device)
                    gen.manual_seed(_mix(seed, t))
                for chunk in _chunks(gi, mi, vi, pi):
                    _chunk_step(*chunk, step, decayed, gen, scale)
                gi.zero_()
        advance_counter(state.count, state.lr, step_lr)
        return updates, AdamWBf16State(state.count, state.lr, state.mu, state.nu)

    def next_lr(state: AdamWBf16State) -> float:
        return lr_at(lr, state.count)

    return GradientTransformation(init, update, next_lr, takes_scaled=True)


def _mix(seed: int, count: int) -> int:
    """A 63-bit generator seed from (seed, update count): a splitmix64 finalizer, so that
    neighbouring counts give unrelated streams."""
    x = (seed * 0x9E3779B97F4A7C15 + count) & ((1 << 64) - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 31)) >> 1


def _kernel_applies(g: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether the one-pass Triton kernel (`_adamw_bf16_kernel`) takes a leaf: contiguous CUDA
    tensors (the moments always are), with triton importable."""
    return (
        p.device.type == "cuda"
        and _triton.available()
        and g.is_contiguous()
        and p.is_contiguous()
        and g.dtype in (torch.float32, torch.bfloat16)
    )


def _kernel_step(
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    p: torch.Tensor,
    step: AdamWStep,
    decayed: bool,
    key: int,
    scale: torch.Tensor | None,
) -> None:
    from twinkle_fn.optim import _adamw_bf16_kernel  # imports triton: only paid on CUDA

    _adamw_bf16_kernel.adamw_bf16_step_(
        g,
        m,
        v,
        p,
        seed=key % (1 << 31),
        b1=step.b1,
        b2=step.b2,
        eps=step.eps,
        step_size=step.step_size,
        bc2_sqrt=step.bc2_sqrt,
        decay_scale=step.decay_scale if decayed else 0.0,
        grad_scale=None if scale is None else scale.to(g.device),
    )


def _chunks(*tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """The four operands of one leaf as matching flat chunks of at most `CHUNK` elements
    (views: in-place writes reach the leaf), or whole when one is not contiguous."""
    if not all(t.is_contiguous() for t in tensors):
        return [tensors]
    flat = [t.view(-1) for t in tensors]
    n = flat[0].numel()
    return [tuple(f[i : i + CHUNK] for f in flat) for i in range(0, n, CHUNK)] or [tensors]


def stochastic_round_(dst: torch.Tensor, x: torch.Tensor, gen: torch.Generator) -> None:
    """Write float32 `x` into the bf16 tensor `dst` (same shape), rounded stochastically.

    Each value rounds up (in magnitude) to the next bf16 with probability equal to its distance
    from the bf16 below, in units of that ulp, so ``E[dst] = x``: 16 uniform random bits are added
    to the float32 bit pattern, then the low 16 bits dropped (an exact cast). Infinities stay;
    NaNs stay NaNs. Draws from `gen` (on `x`'s device).
    """
    noise = torch.randint(0, _LOW_BITS, x.shape, dtype=torch.int32, device=x.device, generator=gen)
    bits = x.contiguous().view(torch.int32) + noise
    rounded = bits.bitwise_and_(_HIGH_MASK).view(torch.float32)
    dst.copy_(torch.where(torch.isnan(x), x, rounded))


def _chunk_step(
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    p: torch.Tensor,
    step: AdamWStep,
    decayed: bool,
    gen: torch.Generator,
    scale: torch.Tensor | None,
) -> None:
    g32 = g.float() if scale is None else g.float() * scale.to(g.device)
    m32 = m.float().lerp_(g32, 1 - step.b1)
    v32 = v.float().mul_(step.b2).addcmul_(g32, g32, value=1 - step.b2)
    del g32
    denom = v32.sqrt().div_(step.bc2_sqrt).add_(step.eps)
    u = m32.div(denom).mul_(step.step_size)
    del denom
    if p.dtype == torch.float32:
        if decayed:
            u.add_(p, alpha=step.decay_scale)
        p.add_(u)
    else:
        p32 = p.float()
        if decayed:
            u.add_(p32, alpha=step.decay_scale)
        stochastic_round_(p, p32.add_(u), gen)
    del u
    stochastic_round_(m, m32, gen)
    stochastic_round_(v, v32, gen)
