"""AdamW's elementwise step over many tensors in one Triton kernel (a multi-tensor apply).

`adamw_step_` reads each element's gradient, moments (and the parameter, where it is decayed)
once, and writes the new moments and the update ``u`` (into the gradient's buffer) once: 28 bytes
of memory traffic per float32 element, where the same math as ``torch._foreach_*`` passes moves
about 100. One launch covers every tensor of a dtype: a small int64 table (the tensors'
addresses and sizes, and which tensor each program works on) goes to the device with an
asynchronous copy from pinned memory, so the step needs no host sync.

The math follows `twinkle_fn.optim.adamw`'s foreach path op for op, in float32 registers:
``m <- lerp(m, g, 1-b1)``, ``v <- fma(1-b2, g*g, b2*v)``, ``d <- sqrt(v)/sqrt(bc2) + eps``,
``u <- (-lr/bc1) * (m/d)``, then ``u <- fma(-lr*wd, p, u)`` on decayed tensors. Square root and
division are IEEE round-to-nearest (``sqrt_rn``, ``div_rn``; Triton's defaults approximate) and the
multiply-adds are explicit ``fma`` where nvcc contracts torch's CUDA kernels, so float32 results
are those of the foreach path on CUDA up to a rare ulp. bf16/fp16 tensors are rounded only when
stored, as in torch's ``fused=True`` AdamW, whereas the foreach path rounds every intermediate
(``b2*v``, ``sqrt(v)``, ``d``, ``m/d``) to the tensor dtype.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

# Tensor dtypes the kernel handles (all four operands of a tensor share one); others take the
# foreach path.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# Elements per loop step (8 per thread at 4 warps) and per program: a program streams a chunk of
# one tensor, so a few hundred tensors of very different sizes share one launch and the table
# that maps programs to tensors stays small (one entry per 16K elements).
_BLOCK = 1024
_CHUNK = 16 * _BLOCK
# Rows of the per-tensor table, in this order; the per-program tensor index follows them.
_G, _M, _V, _P, _NUMEL, _DECAY, _FIRST = range(7)
_ROWS = 7


@triton.jit
def _adamw_kernel(
    meta_ptr,  # int64 [7 * n_tensors + programs]: the per-tensor rows, then each program's tensor
    n_tensors,
    lerp_weight,  # 1 - b1
    b2,
    one_minus_b2,
    bc2_sqrt,  # sqrt(1 - b2**t)
    eps,
    step_size,  # -lr / (1 - b1**t)
    decay_scale,  # -lr * weight_decay
    grad_scale_ptr,  # float32 [1]: the gradients' pending factor (read only when SCALED)
    DTYPE: tl.constexpr,
    SCALED: tl.constexpr,
    LERP_SMALL: tl.constexpr,  # lerp_weight < 0.5: torch's lerp formula differs on each side
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(meta_ptr + 7 * n_tensors + pid)
    g_ptr = tl.load(meta_ptr + t).to(tl.pointer_type(DTYPE))
    m_ptr = tl.load(meta_ptr + n_tensors + t).to(tl.pointer_type(DTYPE))
    v_ptr = tl.load(meta_ptr + 2 * n_tensors + t).to(tl.pointer_type(DTYPE))
    p_ptr = tl.load(meta_ptr + 3 * n_tensors + t).to(tl.pointer_type(DTYPE))
    numel = tl.load(meta_ptr + 4 * n_tensors + t)
    decayed = tl.load(meta_ptr + 5 * n_tensors + t) != 0
    start = (pid - tl.load(meta_ptr + 6 * n_tensors + t)) * CHUNK
    end = tl.minimum(start + CHUNK, numel)
    for step in range(0, CHUNK, BLOCK):
        offsets = start + step + tl.arange(0, BLOCK)
        mask = offsets < end
        g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if SCALED:
            g = g * tl.load(grad_scale_ptr)
        m = tl.load(m_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        # the parameter is read only where it is decayed; elsewhere p = 0 adds nothing to u
        p = tl.load(p_ptr + offsets, mask=mask & decayed, other=0.0).to(tl.float32)
        m = (
            tl.fma(lerp_weight, g - m, m)
            if LERP_SMALL  # torch's lerp: self + w*(end - self), else end - (end - self)*(1 - w)
            else tl.fma(m - g, 1.0 - lerp_weight, g)
        )
        v = tl.fma(one_minus_b2, g * g, v * b2)
        denom = tl.math.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        u = tl.fma(decay_scale, p, step_size * tl.math.div_rn(m, denom))
        tl.store(m_ptr + offsets, m.to(DTYPE), mask=mask)
        tl.store(v_ptr + offsets, v.to(DTYPE), mask=mask)
        tl.store(g_ptr + offsets, u.to(DTYPE), mask=mask)


def adamw_step_(
    grads: Sequence[torch.Tensor],
    mus: Sequence[torch.Tensor],
    nus: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor | None],
    *,
    b1: float,
    b2: float,
    eps: float,
    step_size: float,
    bc2_sqrt: float,
    decay_scale: float,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """One AdamW step for every tensor, in place: the moments advance, and each gradient's buffer
    receives its update ``u`` (``step_size * m/(sqrt(v)/bc2_sqrt + eps) + decay_scale * p``).

    `grad_scale`, a float32 0-d tensor on the tensors' device (or None), multiplies every
    gradient as it is read: a factor not yet applied (token normalisation, clipping; see
    `twinkle_fn.optim.base.ScaledUpdates`). In float32 that agrees with multiplying the
    gradients in place first to within an ulp (the GPU compiler may fuse the product into the
    first moment's update); a bf16/fp16 gradient's product stays in float32 (one rounding fewer
    than a multiply in the tensor dtype). Raises ``ValueError`` for a `grad_scale` of another
    size, dtype or device.

    ``params[i]`` is the parameter of a decayed tensor, ``None`` for one without weight decay.
    All tensors must be contiguous, on one device, with one dtype from `KERNEL_DTYPES`, and
    ``grads[i]``, ``mus[i]``, ``nus[i]`` (and ``params[i]``) of one shape. Scalars are host
    floats (rounded to float32, as torch's foreach kernels round their scalars), so no sync.
    Raises ``ValueError`` for operands the kernel cannot take.
    """
    tensors = [*grads, *mus, *nus, *(p for p in params if p is not None)]
    if not tensors:
        return
    device, dtype = grads[0].device, grads[0].dtype
    for t in tensors:
        if t.device != device or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(
                f"adamw_step_: every tensor must be contiguous, on {device}, of {dtype}; got a "
                f"{t.dtype} tensor on {t.device} (contiguous={t.is_contiguous()})"
            )
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"adamw_step_: dtype {dtype} is not one of {KERNEL_DTYPES}")
    if grad_scale is not None and (
        grad_scale.numel() != 1 or grad_scale.dtype != torch.float32 or grad_scale.device != device
    ):
        raise ValueError(
            f"adamw_step_: grad_scale must be one float32 element on {device}; got "
            f"{grad_scale.dtype} of shape {tuple(grad_scale.shape)} on {grad_scale.device}"
        )
    for g, m, v, p in zip(grads, mus, nus, params, strict=True):
        if m.shape != g.shape or v.shape != g.shape or (p is not None and p.shape != g.shape):
            raise ValueError(f"adamw_step_: operands of one tensor differ in shape ({g.shape})")
    numels = [g.numel() for g in grads]
    programs = [-(-n // _CHUNK) for n in numels]
    total = sum(programs)
    if total == 0:
        return
    n = len(grads)
    rows = [
        [g.data_ptr() for g in grads],
        [m.data_ptr() for m in mus],
        [v.data_ptr() for v in nus],
        # an undecayed tensor's parameter is never read: any valid address will do
        [(g if p is None else p).data_ptr() for g, p in zip(grads, params, strict=True)],
        numels,
        [int(p is not None) for p in params],
        list(itertools.accumulate(programs, initial=0))[:-1],
    ]
    on_cuda = device.type == "cuda"
    # Built in a Python array, not with torch ops: a few thousand ints, where each CPU op
    # (repeat_interleave, a tensor from a list) costs the host more than the whole table.
    table = array.array("q", itertools.chain.from_iterable(rows))
    table.extend(itertools.chain.from_iterable(map(itertools.repeat, range(n), programs)))
    meta = torch.empty(len(table), dtype=torch.int64, pin_memory=on_cuda)
    meta.copy_(torch.frombuffer(table, dtype=torch.int64))
    # pinned + non_blocking: the copy is queued on the stream, the host does not wait for it
    meta = meta.to(device, non_blocking=True)
    lerp_weight = 1.0 - b1
    scaled = grad_scale is not None
    args = (meta, n, lerp_weight, b2, 1.0 - b2, bc2_sqrt, eps, step_size, decay_scale)
    args += (grad_scale if scaled else meta,)  # any tensor will do where it is not read
    kwargs = dict(
        DTYPE=_TRITON_DTYPES[dtype],
        SCALED=scaled,
        LERP_SMALL=abs(lerp_weight) < 0.5,
        BLOCK=_BLOCK,
        CHUNK=_CHUNK,
    )
    if on_cuda:
        with torch.cuda.device(device):
            _adamw_kernel[(total,)](*args, **kwargs)
    else:  # only Triton's CPU interpreter (TRITON_INTERPRET=1) runs it on CPU tensors
        _adamw_kernel[(total,)](*args, **kwargs)
