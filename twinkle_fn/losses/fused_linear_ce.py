"""Cross entropy fused with the lm_head projection, chunked so the logits never exist in full.

``fused_linear_cross_entropy_sum(hidden, weight, labels)`` equals
``cross_entropy_sum(hidden @ weight.T + bias, labels)`` without materialising the
``[tokens, vocab]`` logits. Forward walks over the supervised tokens ``chunk_size`` at a time; for
each chunk it computes the logits in float32, the chunk's loss sum, and, since the gradient of a
token-sum CE w.r.t. its logits is just ``softmax - onehot``, the chunk's gradients w.r.t. hidden,
weight and bias. Backward then only scales those stored gradients by ``grad_output``.

Memory: the transient peak is O(chunk_size · vocab): one ``[chunk, vocab]`` buffer in the
accumulation dtype (float32, float64 for float64 inputs) holds the logits and then the softmax in
place; bfloat16/float16 inputs add one ``[chunk, vocab]`` tensor in the input dtype (the matmul
output, later the gradient cast back for the matmuls). So ``chunk · vocab · 6`` bytes for bf16,
``· 4`` for float32, ``· 8`` for float64, plus a ``[vocab, hidden]`` temporary per chunk for the
low-precision weight gradient. Stored until backward, each only when needed: the hidden gradient
``[tokens, hidden]`` in the input dtype and the weight/bias gradient in the accumulation dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from twinkle_fn.losses.cross_entropy import LossOutput, accumulation_dtype, validate_labels


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


def _chunk_loss_and_grads(
    h: Tensor,  # [chunk, hidden]
    y: Tensor,  # [chunk] int64
    weight: Tensor,  # [vocab, hidden]
    bias: Tensor | None,  # [vocab], in the accumulation dtype
    acc: torch.dtype,
    need_hidden: bool,
    grad_weight: Tensor | None,  # [vocab, hidden] acc, accumulated into when given
    grad_bias: Tensor | None,  # [vocab] acc, accumulated into when given
) -> tuple[Tensor, Tensor | None]:
    """One chunk's CE sum (0-d, acc) and its gradient w.r.t. `h` (when `need_hidden`)."""
    y = y.unsqueeze(1)
    logits = (h @ weight.t()).to(acc)  # [chunk, vocab]
    if bias is not None:
        logits += bias
    target = logits.gather(1, y)
    # softmax in place in the one [chunk, vocab] buffer: logits -> exp(logits - max) -> probs
    row_max = logits.amax(1, keepdim=True)
    probs = logits.sub_(row_max).exp_()
    denom = probs.sum(1, keepdim=True)
    loss = (row_max + denom.log() - target).sum()
    if not (need_hidden or grad_weight is not None or grad_bias is not None):
        return loss, None

    # d(sum of CE) / d(logits) = softmax - onehot(label)
    grad_logits = probs.div_(denom).scatter_add_(1, y, torch.full_like(target, -1.0))
    if grad_bias is not None:
        grad_bias += grad_logits.sum(0)
    grad_logits = grad_logits.to(h.dtype)
    del logits, probs  # a low-precision input frees the float32 buffer before the matmuls
    if grad_weight is not None:
        if grad_logits.dtype == acc:
            grad_weight.addmm_(grad_logits.t(), h)
        else:
            grad_weight += grad_logits.t() @ h
    return loss, (grad_logits @ weight if need_hidden else None)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Token-sum CE of ``hidden @ weight.T + bias``; gradients computed in forward."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        hidden: Tensor,  # [tokens, hidden]
        weight: Tensor,  # [vocab, hidden]
        bias: Tensor | None,  # [vocab]
        labels: Tensor,  # [tokens] int64, every entry in [0, vocab) where supervised
        supervised: Tensor,  # [tokens] bool
        chunk_size: int,
    ) -> Tensor:
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        acc = accumulation_dtype(hidden.dtype)
        # One host sync per call: the loop bounds depend on how many tokens are supervised.
        # In exchange only supervised tokens are projected, so prompt and padding cost nothing.
        rows = supervised.nonzero().squeeze(1)
        num_supervised = rows.numel()
        all_supervised = num_supervised == hidden.shape[0]

        loss = torch.zeros((), dtype=acc, device=hidden.device)
        # rows of ignored tokens are never written, so they must start at zero
        new_grad = torch.empty_like if all_supervised else torch.zeros_like
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
            chunk_loss, grad_h = _chunk_loss_and_grads(
                h, y, weight, bias_acc, acc, need_hidden, grad_weight, grad_bias
            )
            loss += chunk_loss
            if grad_h is None:
                continue
            if all_supervised:
                grad_hidden[index] = grad_h
            else:
                grad_hidden.index_copy_(0, index, grad_h)

        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.chunk_size = chunk_size
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        grads = []
        for grad, dtype in zip(ctx.saved_tensors, ctx.dtypes, strict=True):
            if grad is None:
                grads.append(None)
            elif grad.dim() == 1:
                grads.append((grad * grad_output).to(dtype))
            else:
                grads.append(_scale(grad, grad_output, dtype, ctx.chunk_size))
        return *grads, None, None, None


def fused_linear_cross_entropy_sum(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    chunk_size: int = 4096,
) -> LossOutput:
    """Token-sum cross entropy of ``hidden @ weight.T (+ bias)`` without the full logits.

    Equal to ``cross_entropy_sum(hidden @ weight.T + bias, labels, ignore_index)`` in value and
    gradients (up to float rounding), at O(chunk_size · vocab) transient memory instead of
    O(tokens · vocab); see the module docstring for the exact budget. `chunk_size` counts
    supervised tokens: ignored tokens are skipped before projection, so a fully ignored batch
    costs no matmul and gives loss 0, num_tokens 0 and zero gradients.

    Gradients flow to whichever of hidden, weight and bias require them (a frozen or LoRA head,
    a detached trunk); work for the others is skipped. A weight shared with the input embedding
    (tied embeddings) receives the sum of both gradients through autograd as usual.
    Finding the supervised tokens reads their count on the host: one sync per call.

    Args:
        hidden: ``[..., hidden]`` float32, float64, bfloat16 or float16; flattened to
            ``[tokens, hidden]``.
        weight: ``[vocab, hidden]``, the lm_head weight, same dtype and device as `hidden`.
        labels: ``[...]`` integer token ids matching hidden's leading dims, already shifted.
        bias: optional ``[vocab]`` lm_head bias, same dtype as `hidden`.
        ignore_index: label value of unsupervised tokens.
        chunk_size: supervised tokens per chunk; larger is faster and uses more memory.

    Returns:
        ``LossOutput(loss_sum, num_tokens)``: loss_sum float32 (float64 for float64 inputs),
        gradients returned in each input's dtype (weight/bias accumulated in float32).

    Raises:
        ValueError: a shape, dtype or device mismatch between the arguments, non-integer labels,
            labels outside ``[0, vocab)`` other than ignore_index (checked for CPU labels only,
            see `validate_labels`), or chunk_size < 1.
    """
    _validate(hidden, weight, bias, chunk_size)
    validate_labels(
        labels, hidden.shape[:-1], weight.shape[0], ignore_index, against="hidden [..., hidden]"
    )
    if labels.device != hidden.device:
        raise ValueError(f"labels are on {labels.device} but hidden is on {hidden.device}")
    labels = labels.reshape(-1)
    supervised = labels != ignore_index
    loss_sum = _FusedLinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        bias,
        labels.long(),
        supervised,
        chunk_size,
    )
    return LossOutput(loss_sum, supervised.sum())


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
