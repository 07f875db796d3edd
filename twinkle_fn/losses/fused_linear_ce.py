"""Cross entropy fused with the lm_head projection, chunked so the logits never exist in full.

``fused_linear_cross_entropy_sum(hidden, weight, labels)`` equals
``cross_entropy_sum(hidden @ weight.T + bias, labels)`` without materialising the
``[tokens, vocab]`` logits. Forward walks over the supervised tokens ``chunk_size`` at a time; for
each chunk it computes the logits, each token's loss (softmax math in float32, float64 for float64
inputs) and, since the gradient of a token-sum CE w.r.t. its logits is just ``softmax - onehot``,
the chunk's gradients w.r.t. hidden, weight and bias. Backward then only scales those stored
gradients by ``grad_output``. The per-token losses can be returned too (detached).

On CUDA the per-chunk softmax, loss and logits gradient are one Triton kernel (`_ce_kernel`) for
bfloat16, float16 and float32 inputs; the torch ops below are the fallback and the reference.

Memory: the transient peak is O(chunk_size · vocab). With the kernel, one ``[chunk, vocab]``
buffer in the input dtype holds the logits and then, in place, their gradient: ``chunk · vocab ·
2`` bytes for bf16/fp16, ``· 4`` for float32. With torch ops, one ``[chunk, vocab]`` buffer in
the accumulation dtype (float32, float64 for float64 inputs) holds the logits and then the softmax
in place; bfloat16/float16 inputs add one ``[chunk, vocab]`` tensor in the input dtype (the matmul
output, later the gradient cast back for the matmuls). So ``chunk · vocab · 6`` bytes for bf16,
``· 4`` for float32, ``· 8`` for float64. Off CUDA, add a ``[vocab, hidden]`` temporary per chunk
for the low-precision weight gradient (on CUDA the matmul accumulates it in float32 itself).
Stored until backward, each only when needed: the hidden gradient ``[tokens, hidden]`` in the
input dtype and the weight/bias gradient in the accumulation dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from twinkle_fn import _triton
from twinkle_fn.losses.cross_entropy import LossOutput, accumulation_dtype, validate_labels

# Supervised tokens per chunk. The loss runs while the whole forward's activations are alive, so
# its [chunk, vocab] buffer adds to the step's peak: 0.58 GiB at a 151,936-token vocab in bf16
# (4096 rows: 1.16 GiB). On an H200 the weight gradient's matmul (K = chunk) runs at 508 TFLOP/s
# with 1024 rows and 624 with 2048; all three of a chunk's matmuls take 2.43 ms per 2048 rows at
# hidden 896, 2.62 ms as two chunks of 1024 (benchmarks/NOTES.md).
DEFAULT_CHUNK_SIZE = 2048


class TokenLossOutput(NamedTuple):
    """`LossOutput`'s two fields plus each token's cross entropy.

    ``loss_sum``, ``num_tokens``: as in `LossOutput`.
    ``token_losses``: ``[...]`` shaped like the labels, detached, in loss_sum's dtype (float32,
    float64 for float64 inputs): ``-log p(label)`` of each token, 0 where the label is ignored.
    """

    loss_sum: Tensor
    num_tokens: Tensor
    token_losses: Tensor


def _scale(grad: Tensor, scale: Tensor, dtype: torch.dtype, rows_per_step: int) -> Tensor:
    """``grad * scale`` cast to `dtype`, multiplied in `scale`'s dtype a block of rows at a time.

    Multiplying in the low-precision dtype would round `scale` (typically 1 / num_tokens) to bf16
    first; converting the whole of `grad` to float32 at once would double its memory.
    """
    if grad.dtype == scale.dtype == dtype:
        return grad * scale
    out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    for start in range(0, grad.shape[0], rows_per_step):
        rows = slice(start, start + rows_per_step)
        torch.mul(grad[rows].to(scale.dtype), scale, out=out[rows])
    return out


def _kernel_applies(hidden: Tensor) -> bool:
    """Whether the chunks' softmax runs in the Triton kernel (CUDA, a dtype it handles)."""
    if hidden.device.type != "cuda" or not _triton.available():
        return False
    from twinkle_fn.losses import _ce_kernel  # imports triton: only paid on CUDA

    return hidden.dtype in _ce_kernel.KERNEL_DTYPES


def _torch_rows(
    h: Tensor,  # [chunk, hidden]
    weight: Tensor,  # [vocab, hidden]
    y: Tensor,  # [chunk, 1] int64
    bias: Tensor | None,  # [vocab] acc
    acc: torch.dtype,
    need_grad: bool,
    grad_bias: Tensor | None,  # [vocab] acc, accumulated into when given
) -> tuple[Tensor, Tensor | None]:
    """Per-row CE ([chunk], acc) and ``softmax - onehot`` in h's dtype, in torch ops."""
    # one expression, so that a low-precision matmul output is freed once upcast
    logits = (h @ weight.t()).to(acc)  # [chunk, vocab]
    if bias is not None:
        logits += bias
    target = logits.gather(1, y)
    # softmax in place in the one [chunk, vocab] buffer: logits -> exp(logits - max) -> probs
    row_max = logits.amax(1, keepdim=True)
    probs = logits.sub_(row_max).exp_()
    denom = probs.sum(1, keepdim=True)
    losses = (row_max + denom.log() - target).squeeze(1)
    if not need_grad:
        return losses, None
    # d(sum of CE) / d(logits) = softmax - onehot(label)
    grad_logits = probs.div_(denom).scatter_add_(1, y, torch.full_like(target, -1.0))
    if grad_bias is not None:
        grad_bias += grad_logits.sum(0)
    return losses, grad_logits.to(h.dtype)


def _chunk_loss_and_grads(
    h: Tensor,  # [chunk, hidden]
    y: Tensor,  # [chunk] int64
    weight: Tensor,  # [vocab, hidden]
    bias: Tensor | None,  # [vocab], in the accumulation dtype
    acc: torch.dtype,
    use_kernel: bool,
    need_hidden: bool,
    grad_weight: Tensor | None,  # [vocab, hidden] acc, accumulated into when given
    grad_bias: Tensor | None,  # [vocab] acc, accumulated into when given
) -> tuple[Tensor, Tensor | None]:
    """One chunk's per-token CE ([chunk], acc) and its gradient w.r.t. `h` (when `need_hidden`)."""
    need_grad = need_hidden or grad_weight is not None or grad_bias is not None
    if use_kernel:
        from twinkle_fn.losses import _ce_kernel

        # the kernel overwrites the logits with their gradient: one [chunk, vocab] buffer
        grad_logits = h @ weight.t()  # [chunk, vocab]
        losses = _ce_kernel.cross_entropy_rows_(grad_logits, y, bias, write_grad=need_grad)
        if grad_bias is not None:
            # sums the rounded gradient, the same one the weight gradient is made of
            grad_bias += grad_logits.sum(0, dtype=acc)
    else:
        # a low-precision input frees the float32 buffer on return, before the matmuls
        losses, grad_logits = _torch_rows(
            h, weight, y.unsqueeze(1), bias, acc, need_grad, grad_bias
        )
    if not need_grad:
        return losses, None
    if grad_weight is not None:
        _accumulate_weight_grad(grad_weight, grad_logits, h)
    return losses, (grad_logits @ weight if need_hidden else None)


def _accumulate_weight_grad(
    grad_weight: Tensor,  # [vocab, hidden] acc
    grad_logits: Tensor,  # [chunk, vocab]
    h: Tensor,  # [chunk, hidden], grad_logits' dtype
) -> None:
    """``grad_weight += grad_logits.T @ h``, summed in grad_weight's dtype.

    On CUDA a low-precision product is accumulated by the matmul itself (a float32 output of
    bf16/fp16 inputs): no ``[vocab, hidden]`` temporary, and no rounding of each chunk's partial
    sum to the input dtype. Elsewhere the product is made in the inputs' dtype and then added.
    """
    if grad_logits.dtype == grad_weight.dtype:
        grad_weight.addmm_(grad_logits.t(), h)
    elif grad_weight.is_cuda:
        torch.addmm(grad_weight, grad_logits.t(), h, out_dtype=grad_weight.dtype, out=grad_weight)
    else:
        grad_weight += grad_logits.t() @ h


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Token-sum CE of ``hidden @ weight.T + bias`` and the per-token CE (not differentiable).

    Gradients are computed in forward.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        hidden: Tensor,  # [tokens, hidden]
        weight: Tensor,  # [vocab, hidden]
        bias: Tensor | None,  # [vocab]
        labels: Tensor,  # [tokens] int64, every entry in [0, vocab) where supervised
        rows: Tensor,  # [supervised tokens] int64, ascending flat indices
        chunk_size: int,
    ) -> tuple[Tensor, Tensor]:
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        acc = accumulation_dtype(hidden.dtype)
        use_kernel = _kernel_applies(hidden)
        num_supervised = rows.numel()
        all_supervised = num_supervised == hidden.shape[0]

        # rows of ignored tokens are never written, so they must start at zero
        new_grad = torch.empty_like if all_supervised else torch.zeros_like
        token_losses = new_grad(labels, dtype=acc)  # [tokens]
        grad_hidden = new_grad(hidden) if need_hidden else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
        )
        grad_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_bias else None
        bias_acc = bias.to(acc) if bias is not None else None

        for start in range(0, num_supervised, chunk_size):
            if all_supervised:
                index = slice(start, start + chunk_size)
                h, y = hidden[index], labels[index]  # views, no copy
            else:
                index = rows[start : start + chunk_size]
                h, y = hidden.index_select(0, index), labels.index_select(0, index)
            # a function call, so that this chunk's [chunk, vocab] buffers are freed before the
            # next chunk allocates its own
            chunk_losses, grad_h = _chunk_loss_and_grads(
                h, y, weight, bias_acc, acc, use_kernel, need_hidden, grad_weight, grad_bias
            )
            if all_supervised:
                token_losses[index] = chunk_losses
            else:
                token_losses.index_copy_(0, index, chunk_losses)
            if grad_h is None:
                continue
            if all_supervised:
                grad_hidden[index] = grad_h
            else:
                grad_hidden.index_copy_(0, index, grad_h)

        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(token_losses)
        return token_losses.sum(), token_losses

    @staticmethod
    @once_differentiable
    def backward(
        ctx: FunctionCtx, grad_output: Tensor, _grad_token_losses: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        grads = []
        for grad, dtype in zip(ctx.saved_tensors, ctx.dtypes, strict=True):
            if grad is None:
                grads.append(None)
            elif grad.dim() == 1:
                grads.append((grad * grad_output).to(dtype))
            else:
                grads.append(_scale(grad, grad_output, dtype, ctx.chunk_size))
        return *grads, None, None, None


def supervised_rows(
    labels: Tensor, ignore_index: int = -100, device: torch.device | str | None = None
) -> Tensor:
    """Flat indices ``[supervised tokens]`` (int64, ascending) of the labels not `ignore_index`.

    Computed where `labels` are and then moved to `device` (default: the labels' device). The
    count is data-dependent, so on an accelerator this reads it on the host (one device sync);
    on CPU labels, which is where a data loader's batches start, it costs no sync at all. Pass
    the result as `fused_linear_cross_entropy_sum`'s ``supervised_rows`` so that the loss, which
    runs mid-step, does not stall the device queue: compute it before the forward is queued.
    """
    rows = (labels.reshape(-1) != ignore_index).nonzero().squeeze(1)
    return rows if device is None else rows.to(device, non_blocking=True)


def fused_linear_cross_entropy_sum(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    return_token_losses: bool = False,
    supervised_rows: Tensor | None = None,
) -> LossOutput | TokenLossOutput:
    """Token-sum cross entropy of ``hidden @ weight.T (+ bias)`` without the full logits.

    Equal to ``cross_entropy_sum(hidden @ weight.T + bias, labels, ignore_index)`` in value and
    gradients (up to float rounding), at O(chunk_size · vocab) transient memory instead of
    O(tokens · vocab); see the module docstring for the exact budget. `chunk_size` counts
    supervised tokens: ignored tokens are skipped before projection, so a fully ignored batch
    costs no matmul and gives loss 0, num_tokens 0 and zero gradients.

    Gradients flow to whichever of hidden, weight and bias require them (a frozen or LoRA head,
    a detached trunk); work for the others is skipped. A weight shared with the input embedding
    (tied embeddings) receives the sum of both gradients through autograd as usual.
    Finding the supervised tokens reads their count on the host: one device sync per call,
    unless `supervised_rows` (from `supervised_rows`, computed before the forward) are passed.

    On CUDA with bfloat16, float16 or float32 inputs each chunk's softmax, loss and logits
    gradient run in one Triton kernel that overwrites the chunk's logits with their gradient;
    elsewhere (CPU, float64, no triton) in torch ops. Both compute in float32 (float64 for
    float64) and round the logits gradient to the input dtype once. The kernel's bias gradient
    sums that rounded gradient (as the weight gradient does); the torch path sums it unrounded.

    Args:
        hidden: ``[..., hidden]`` float32, float64, bfloat16 or float16; flattened to
            ``[tokens, hidden]``.
        weight: ``[vocab, hidden]``, the lm_head weight, same dtype and device as `hidden`.
        labels: ``[...]`` integer token ids matching hidden's leading dims, already shifted.
        bias: optional ``[vocab]`` lm_head bias, same dtype as `hidden`.
        ignore_index: label value of unsupervised tokens.
        chunk_size: supervised tokens per chunk; larger is faster and uses more memory.
        return_token_losses: also return each token's cross entropy (its negated log p(label)),
            computed anyway, at no extra cost.
        supervised_rows: ``supervised_rows(labels, ignore_index)`` computed earlier, on
            hidden's device; it is trusted to match `labels` (checking would need the sync it
            saves). None computes it here.

    Returns:
        ``LossOutput(loss_sum, num_tokens)``: loss_sum float32 (float64 for float64 inputs),
        gradients returned in each input's dtype (weight/bias accumulated in float32).
        With `return_token_losses`, ``TokenLossOutput(loss_sum, num_tokens, token_losses)``,
        token_losses ``[...]`` shaped like `labels`, detached, 0 at ignored tokens.

    Raises:
        ValueError: a shape, dtype or device mismatch between the arguments, non-integer labels,
            labels outside ``[0, vocab)`` other than ignore_index (checked for CPU labels only,
            see `validate_labels`; on CUDA such a label fails a device-side assertion on the
            torch path and gives a NaN loss in the kernel), chunk_size < 1, or
            `supervised_rows` that are not a 1-d int64 tensor on hidden's device with at most
            one row per token.
    """
    _validate(hidden, weight, bias, chunk_size)
    flat_labels, supervised_rows = _labels_and_rows(
        labels, hidden, weight, ignore_index, supervised_rows
    )
    supervised = flat_labels != ignore_index
    loss_sum, token_losses = _FusedLinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        bias,
        flat_labels.long(),
        supervised_rows,
        chunk_size,
    )
    if return_token_losses:
        return TokenLossOutput(loss_sum, supervised.sum(), token_losses.view(labels.shape))
    return LossOutput(loss_sum, supervised.sum())


def _labels_and_rows(
    labels: Tensor, hidden: Tensor, weight: Tensor, ignore_index: int, rows: Tensor | None
) -> tuple[Tensor, Tensor]:
    """``(labels [N], supervised rows [n])`` for `hidden` ``[..., hidden]``: the labels
    flattened after checking them against `hidden` and `weight` ``[vocab, hidden]``
    (`validate_labels`, and their device), and `rows` checked (`_validate_rows`), or when None
    the indices of the labels other than `ignore_index`. Raises ``ValueError`` as those checks do.
    """
    validate_labels(
        labels, hidden.shape[:-1], weight.shape[0], ignore_index, against="hidden [..., hidden]"
    )
    if labels.device != hidden.device:
        raise ValueError(f"labels are on {labels.device} but hidden is on {hidden.device}")
    flat = labels.reshape(-1)
    if rows is None:
        return flat, (flat != ignore_index).nonzero().squeeze(1)
    _validate_rows(rows, hidden, flat.numel())
    return flat, rows


def _validate_rows(rows: Tensor, hidden: Tensor, num_tokens: int) -> None:
    """Raise ValueError unless `rows` can be supervised row indices of `num_tokens` tokens."""
    if rows.dim() != 1 or rows.dtype != torch.int64:
        raise ValueError(
            f"supervised_rows must be 1-d int64 indices, got {rows.dtype} of shape "
            f"{tuple(rows.shape)}; build them with supervised_rows(labels, ignore_index)"
        )
    if rows.device != hidden.device:
        raise ValueError(f"supervised_rows are on {rows.device} but hidden is on {hidden.device}")
    if rows.numel() > num_tokens:
        raise ValueError(
            f"{rows.numel()} supervised_rows for {num_tokens} tokens: they belong to other labels"
        )


def _validate(hidden: Tensor, weight: Tensor, bias: Tensor | None, chunk_size: int) -> None:
    """Raise ValueError unless hidden, weight, bias and chunk_size fit together."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if not hidden.dtype.is_floating_point:
        raise ValueError(f"hidden must be floating point, got dtype {hidden.dtype}")
    if hidden.dim() < 1:
        raise ValueError("hidden must be [..., hidden], got a 0-d tensor")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be [vocab, hidden] = [vocab, {hidden.shape[-1]}] to match hidden "
            f"{tuple(hidden.shape)}, got {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight has an empty vocab dim")
    tensors = {"weight": weight} if bias is None else {"weight": weight, "bias": bias}
    for name, tensor in tensors.items():
        if tensor.dtype != hidden.dtype:
            raise ValueError(
                f"{name} dtype {tensor.dtype} differs from hidden dtype {hidden.dtype}; "
                "cast one of them (e.g. run the lm_head in the trunk's dtype)"
            )
        if tensor.device != hidden.device:
            raise ValueError(f"{name} is on {tensor.device} but hidden is on {hidden.device}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be [vocab] = [{weight.shape[0]}], got {tuple(bias.shape)}")
