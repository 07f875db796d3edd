"""Row-wise cross entropy and its logits gradient in one Triton kernel, in place.

`cross_entropy_rows_` is the elementwise half of the fused linear + cross-entropy on CUDA: for each
row of a ``[rows, vocab]`` logits chunk it computes ``logsumexp(row) - row[label]`` and overwrites
the row with ``softmax(row) - onehot(label)`` in the row's dtype. One program per row reads the row
twice (an online max / sum of exponentials, then the gradient) and writes it once, all in float32
registers: about 6 bytes of memory traffic per bf16 logit, where the same math in torch ops
(upcast, gather, amax, sub, exp, sum, log, div, scatter, downcast) moves about 34 and needs a
float32 ``[rows, vocab]`` buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# Logits dtypes the kernel handles; anything else (float64) takes the torch path.
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Elements per loop step: enough in flight per program to keep the memory system busy, few
# enough registers per thread (16 at 16 warps) to keep several programs resident per SM.
_MAX_BLOCK = 8192


@triton.jit
def _cross_entropy_rows_kernel(
    logits_ptr,  # [rows, vocab], unit stride along vocab; overwritten by the gradient
    labels_ptr,  # [rows] int64
    bias_ptr,  # [vocab] float32, read only when HAS_BIAS
    loss_ptr,  # [rows] float32, written
    vocab,
    row_stride,
    HAS_BIAS: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    label = tl.load(labels_ptr + row)
    # An out-of-range label must not read another row: its target is NaN, so the loss is NaN.
    in_range = (label >= 0) & (label < vocab)
    # read before the gradient pass overwrites the row
    target = tl.load(row_ptr + label, mask=in_range, other=float("nan")).to(tl.float32)
    if HAS_BIAS:
        target += tl.load(bias_ptr + label, mask=in_range, other=0.0)

    # online logsumexp: one exp per element, the running sum rescaled once per block. The max
    # starts at the lowest finite float32, not -inf: a block of -inf logits (a -inf bias) would
    # otherwise give exp(-inf - -inf) = NaN.
    row_max = -3.4028234663852886e38
    denom = 0.0
    for start in range(0, vocab, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < vocab
        x = tl.load(row_ptr + offsets, mask=mask, other=float("-inf")).to(tl.float32)
        if HAS_BIAS:
            x += tl.load(bias_ptr + offsets, mask=mask, other=0.0)
        new_max = tl.maximum(row_max, tl.max(x, axis=0))
        denom = denom * tl.exp(row_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        row_max = new_max
    tl.store(loss_ptr + row, row_max + tl.log(denom) - target)

    if WRITE_GRAD:
        inv_denom = 1.0 / denom
        for start in range(0, vocab, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            mask = offsets < vocab
            x = tl.load(row_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                x += tl.load(bias_ptr + offsets, mask=mask, other=0.0)
            grad = tl.exp(x - row_max) * inv_denom
            grad = tl.where(offsets == label, grad - 1.0, grad)
            tl.store(row_ptr + offsets, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def cross_entropy_rows_(
    logits: Tensor,  # [rows, vocab]
    labels: Tensor,  # [rows] int64
    bias: Tensor | None = None,  # [vocab] float32
    *,
    write_grad: bool = True,
    block: int | None = None,
) -> Tensor:
    """Per-row ``logsumexp(logits + bias) - (logits + bias)[label]``; the gradient in place.

    The math runs in float32 whatever the logits dtype. With `write_grad`, each row of `logits`
    is overwritten by ``softmax(logits + bias) - onehot(label)`` rounded to the logits dtype,
    the gradient of the row's loss w.r.t. its logits; without it `logits` is only read.
    Every label must lie in ``[0, vocab)``: rows with an ignored label must be left out by the
    caller, and an out-of-range label gives a NaN loss (not an error: checking would cost a
    device sync). `block` (a power of two) overrides the elements per loop step, for tests.

    Returns:
        ``[rows]`` float32 losses.

    Raises:
        ValueError: logits not ``[rows, vocab]`` with unit stride along vocab and a dtype in
            `KERNEL_DTYPES`, labels not ``[rows]`` int64, bias not ``[vocab]`` float32, or the
            tensors on different devices.
    """
    _validate(logits, labels, bias)
    rows, vocab = logits.shape
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return losses
    block = block or min(triton.next_power_of_2(vocab), _MAX_BLOCK)
    _cross_entropy_rows_kernel[(rows,)](
        logits,
        labels.contiguous(),
        losses
        if bias is None
        else bias.contiguous(),  # any valid pointer; never read without HAS_BIAS
        losses,
        vocab,
        logits.stride(0),
        HAS_BIAS=bias is not None,
        WRITE_GRAD=write_grad,
        BLOCK=block,
        num_warps=min(max(block // 512, 1), 16),
    )
    return losses


def _validate(logits: Tensor, labels: Tensor, bias: Tensor | None) -> None:
    """Raise ValueError unless the kernel can read and write these tensors as they are."""
    if logits.dim() != 2 or logits.shape[1] == 0 or logits.stride(1) != 1:
        raise ValueError(
            f"logits must be [rows, vocab] with vocab > 0 and unit stride along vocab, got shape "
            f"{tuple(logits.shape)} strides {logits.stride()}; pass a contiguous tensor"
        )
    if logits.dtype not in KERNEL_DTYPES:
        raise ValueError(f"logits dtype must be one of {KERNEL_DTYPES}, got {logits.dtype}")
    if labels.shape != logits.shape[:1] or labels.dtype != torch.int64:
        raise ValueError(
            f"labels must be [rows] = [{logits.shape[0]}] int64, got {tuple(labels.shape)} "
            f"{labels.dtype}; use labels.long()"
        )
    if bias is not None and (bias.shape != logits.shape[1:] or bias.dtype != torch.float32):
        raise ValueError(
            f"bias must be [vocab] = [{logits.shape[1]}] float32, got {tuple(bias.shape)} "
            f"{bias.dtype}; use bias.float()"
        )
    for name, tensor in (("labels", labels), ("bias", bias)):
        if tensor is not None and tensor.device != logits.device:
            raise ValueError(f"{name} is on {tensor.device} but logits are on {logits.device}")
