"""`adamw_bf16`'s step on one tensor in one Triton kernel: a pass that reads the gradient, the
bf16 moments and the parameter once and writes them once (16 bytes a bf16 element, 20 with a
float32 gradient), where the torch path's float32 temporaries and random-bit tensors move over
200.

The math is `twinkle_fn.optim.adamw_bf16`'s in float32 registers (IEEE square root and division);
the random bits come from Triton's Philox generator (``tl.randint4x``: three independent 32-bit
words per element, one for each of ``p``, ``m`` and ``v``), keyed by a per-tensor seed, so the
kernel and the torch path draw different bits: each rounds the same float32 values to the same
pair of bf16 neighbours, with the same probabilities.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024
_TRITON = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}


@triton.jit
def _stochastic_round(x, r):
    """float32 `x` rounded to bf16 with the low 16 bits of the uint32 `r` as the random bits."""
    bits = x.to(tl.int32, bitcast=True) + (r & 0xFFFF).to(tl.int32)
    rounded = (bits & -65536).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded).to(tl.bfloat16)


@triton.jit
def _adamw_bf16_kernel(
    g_ptr,
    m_ptr,
    v_ptr,
    p_ptr,
    numel,
    seed,
    lerp_weight,  # 1 - b1
    b2,
    one_minus_b2,
    bc2_sqrt,
    eps,
    step_size,  # -lr / (1 - b1**t)
    decay_scale,  # -lr * weight_decay, 0 when not decayed
    grad_scale_ptr,  # float32 [1]: the gradient's pending factor (read only when SCALED)
    P_BF16: tl.constexpr,
    SCALED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        g = g * tl.load(grad_scale_ptr)
    m = tl.load(m_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(p_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    m = m + lerp_weight * (g - m)
    v = v * b2 + one_minus_b2 * g * g
    denom = tl.math.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    new_p = p + (step_size * tl.math.div_rn(m, denom) + decay_scale * p)
    r_p, r_m, r_v, _ = tl.randint4x(seed, offsets)
    if P_BF16:
        tl.store(p_ptr + offsets, _stochastic_round(new_p, r_p), mask=mask)
    else:
        tl.store(p_ptr + offsets, new_p, mask=mask)
    tl.store(m_ptr + offsets, _stochastic_round(m, r_m), mask=mask)
    tl.store(v_ptr + offsets, _stochastic_round(v, r_v), mask=mask)
    tl.store(g_ptr + offsets, tl.zeros_like(g).to(g_ptr.dtype.element_ty), mask=mask)


def adamw_bf16_step_(
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    p: torch.Tensor,
    *,
    seed: int,
    b1: float,
    b2: float,
    eps: float,
    step_size: float,
    bc2_sqrt: float,
    decay_scale: float,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """One `adamw_bf16` step of one tensor, in place: `m`, `v` (bf16) advance and are rounded
    stochastically, `p` (bf16: stochastically; float32: exactly) takes the update (with
    ``decay_scale * p`` added, 0 for an undecayed tensor) and `g` (bf16 or float32) is zeroed.
    `grad_scale`, a float32 0-d tensor on `g`'s device (or None), multiplies the gradient as it
    is read, in float32: a factor not yet applied (`twinkle_fn.optim.base.ScaledUpdates`).

    Every operand is contiguous, of one shape, on one CUDA device (or CPU tensors under Triton's
    interpreter); `seed` is a non-negative int below 2**31 keying the random bits. Raises
    ``ValueError`` for operands the kernel cannot take.
    """
    for name, t, dtypes in (
        ("g", g, _TRITON),
        ("m", m, (torch.bfloat16,)),
        ("v", v, (torch.bfloat16,)),
        ("p", p, _TRITON),
    ):
        if t.dtype not in dtypes or not t.is_contiguous() or t.shape != g.shape:
            raise ValueError(
                f"adamw_bf16_step_: {name} must be contiguous, of shape {tuple(g.shape)} and "
                f"one of {list(dtypes)}; got {t.dtype} {tuple(t.shape)} "
                f"(contiguous={t.is_contiguous()})"
            )
    if grad_scale is not None and (
        grad_scale.numel() != 1
        or grad_scale.dtype != torch.float32
        or grad_scale.device != g.device
    ):
        raise ValueError(
            f"adamw_bf16_step_: grad_scale must be one float32 element on {g.device}; got "
            f"{grad_scale.dtype} of shape {tuple(grad_scale.shape)} on {grad_scale.device}"
        )
    numel = g.numel()
    if numel == 0:
        return
    scaled = grad_scale is not None
    args = (g, m, v, p, numel, seed, 1.0 - b1, b2, 1.0 - b2, bc2_sqrt, eps, step_size)
    args += (decay_scale, grad_scale if scaled else g)  # any tensor will do where it is not read
    grid = (triton.cdiv(numel, _BLOCK),)
    kwargs = dict(P_BF16=p.dtype == torch.bfloat16, SCALED=scaled, BLOCK=_BLOCK)
    if g.device.type == "cuda":
        with torch.cuda.device(g.device):
            _adamw_bf16_kernel[grid](*args, **kwargs)
    else:  # only Triton's CPU interpreter (TRITON_INTERPRET=1) runs it on CPU tensors
        _adamw_bf16_kernel[grid](*args, **kwargs)
