"""Per-token log-probabilities (and entropy) fused with the lm_head, chunked: no full logits.

``fused_linear_token_logps(hidden, weight, labels)`` equals
``token_logps(hidden @ weight.T + bias, labels)`` (and, with `with_entropy`, the softmax's
entropy per token) without materialising the ``[tokens, vocab]`` logits, and is differentiable
w.r.t. hidden, weight and bias. It is what a loss over per-token terms (policy gradients, PPO)
needs in place of the logits: at seq 2048 x batch 8 and a 152k vocabulary the float32 logits,
their log-softmax and their gradient are ~10 GB each.

Unlike the cross entropy (`fused_linear_ce`), whose gradient w.r.t. each token's loss is one
shared scale known in forward, a token loss weighs each token's log-probability by a factor
only known once the loss has run. So forward projects a chunk of supervised tokens at a time and
keeps only ``[tokens]`` results, and backward projects each chunk again (one more lm_head matmul
than the fused cross entropy: 4 instead of 3) to form the logits gradient::

    d logp_t / d z_t = onehot(y_t) - p_t
    d H_t / d z_t    = -p_t * (log p_t + H_t)

with ``z_t`` the token's logits (divided by `temperature`), ``p_t`` their softmax and ``H_t``
its entropy. Softmax math runs in float32 (float64 for float64 inputs); the logits gradient is
rounded to the input dtype once, before the matmuls, as in the fused cross entropy.

On CUDA, log-probabilities alone at temperature 1 (what PPO without an entropy bonus and the
rollouts' log-probs need) run in the cross entropy's Triton kernel (`_ce_kernel`): forward
reads each chunk's logits once for ``-logp``; backward has the kernel overwrite them with
``p - onehot`` and scales each row by ``-g_t`` in place. The entropy and other temperatures take
the torch ops, several passes over each ``[chunk, vocab]`` buffer.

Memory: the transient peak is two ``[chunk, vocab]`` buffers in the accumulation dtype plus,
for low-precision inputs, one in the input dtype. Saved for backward: the inputs themselves
(autograd keeps them alive anyway), and the ``[tokens]`` entropy.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from twinkle_fn.losses.cross_entropy import accumulation_dtype
from twinkle_fn.losses.fused_linear_ce import (
    DEFAULT_CHUNK_SIZE,
    _accumulate_weight_grad,
    _kernel_applies,
    _labels_and_rows,
    _validate,
)


class TokenTerms(NamedTuple):
    """``logps`` ``[...]`` shaped like the labels, in the accumulation dtype (float32, float64
    for float64 inputs), 0 where the label is ignored; ``entropy`` likewise, or None when not
    asked for."""

    logps: Tensor
    entropy: Tensor | None


def _chunk_log_softmax(
    h: Tensor,  # [chunk, hidden]
    weight: Tensor,  # [vocab, hidden]
    bias: Tensor | None,  # [vocab] acc
    acc: torch.dtype,
    temperature: float,
) -> Tensor:
    """``log_softmax((h @ weight.T + bias) / temperature)`` ``[chunk, vocab]`` in `acc`, built in
    one buffer."""
    z = (h @ weight.t()).to(acc)  # [chunk, vocab]
    if bias is not None:
        z += bias
    if temperature != 1.0:
        z /= temperature
    return z.sub_(torch.logsumexp(z, 1, keepdim=True))


def _kernel_logps(h: Tensor, y: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """One chunk's ``[chunk]`` float32 log-probabilities of `y`, in the Triton kernel."""
    from twinkle_fn.losses import _ce_kernel  # imports triton: only paid on CUDA

    return -_ce_kernel.cross_entropy_rows_(h @ weight.t(), y, bias, write_grad=False)


def _kernel_grad_logits(
    h: Tensor, y: Tensor, weight: Tensor, bias: Tensor | None, grad_logps: Tensor
) -> Tensor:
    """``g_t * (onehot - p_t)`` of one chunk ``[chunk, vocab]`` in h's dtype, in the kernel."""
    from twinkle_fn.losses import _ce_kernel

    grad = h @ weight.t()  # [chunk, vocab], overwritten by p - onehot
    _ce_kernel.cross_entropy_rows_(grad, y, bias, write_grad=True)
    # float32 factors: the product is computed in float32 and rounded once
    return grad.mul_(-grad_logps.unsqueeze(1))


def _chunk_terms(
    h: Tensor, y: Tensor, weight: Tensor, bias: Tensor | None, acc: torch.dtype, t: float, ent: bool
) -> tuple[Tensor, Tensor | None]:
    """One chunk's ``[chunk]`` log-probabilities of `y` and (with `ent`) entropies."""
    logp = _chunk_log_softmax(h, weight, bias, acc, t)  # [chunk, vocab]
    picked = logp.gather(1, y.unsqueeze(1)).squeeze(1)
    if not ent:
        return picked, None
    return picked, -(logp.exp() * logp).sum(1)


def _chunk_grad_logits(
    h: Tensor,
    y: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    acc: torch.dtype,
    t: float,
    grad_logps: Tensor,  # [chunk] acc
    grad_entropy: Tensor | None,  # [chunk] acc
    entropy: Tensor | None,  # [chunk] acc
) -> Tensor:
    """d(sum_t g_t logp_t + e_t H_t) / d(raw logits) of one chunk, ``[chunk, vocab]`` in acc."""
    logp = _chunk_log_softmax(h, weight, bias, acc, t)  # [chunk, vocab]
    p = logp.exp()
    grad = p * -grad_logps.unsqueeze(1)
    grad.scatter_add_(1, y.unsqueeze(1), grad_logps.unsqueeze(1))
    if grad_entropy is not None:
        # -p * (log p + H) * e, in logp's buffer
        grad -= logp.add_(entropy.unsqueeze(1)).mul_(p).mul_(grad_entropy.unsqueeze(1))
    return grad / t if t != 1.0 else grad


class _FusedLinearLogps(torch.autograd.Function):
    """Per-token log-probabilities and entropies of ``(hidden @ weight.T + bias) / t``."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        hidden: Tensor,  # [tokens, hidden]
        weight: Tensor,  # [vocab, hidden]
        bias: Tensor | None,  # [vocab]
        labels: Tensor,  # [tokens] int64
        rows: Tensor,  # [supervised tokens] int64, ascending
        chunk_size: int,
        temperature: float,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        acc = accumulation_dtype(hidden.dtype)
        bias_acc = None if bias is None else bias.to(acc)
        use_kernel = _kernel_applies(hidden) and temperature == 1.0 and not with_entropy
        logps = torch.zeros(labels.shape, dtype=acc, device=hidden.device)  # [tokens]
        entropy = torch.zeros_like(logps) if with_entropy else logps.new_zeros(0)
        for start in range(0, rows.numel(), chunk_size):
            index = rows[start : start + chunk_size]
            h, y = hidden.index_select(0, index), labels.index_select(0, index)
            if use_kernel:
                lp, ent = _kernel_logps(h, y, weight, bias_acc), None
            else:
                lp, ent = _chunk_terms(h, y, weight, bias_acc, acc, temperature, with_entropy)
            logps.index_copy_(0, index, lp)
            if ent is not None:
                entropy.index_copy_(0, index, ent)
        ctx.save_for_backward(hidden, weight, bias, labels, rows, entropy)
        ctx.options = (chunk_size, temperature, with_entropy, use_kernel)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    @once_differentiable
    def backward(
        ctx: FunctionCtx, grad_logps: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, labels, rows, entropy = ctx.saved_tensors
        chunk_size, t, with_entropy, use_kernel = ctx.options
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        acc = accumulation_dtype(hidden.dtype)
        bias_acc = None if bias is None else bias.to(acc)
        if grad_logps is None:
            grad_logps = torch.zeros(labels.shape, dtype=acc, device=hidden.device)
        if not with_entropy:
            grad_entropy = None
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
        )
        grad_bias = (
            torch.zeros(weight.shape[:1], dtype=acc, device=weight.device) if need_bias else None
        )
        for start in range(0, rows.numel(), chunk_size):
            index = rows[start : start + chunk_size]
            h, y = hidden.index_select(0, index), labels.index_select(0, index)
            g = grad_logps.index_select(0, index).to(acc)
            e = None if grad_entropy is None else grad_entropy.index_select(0, index).to(acc)
            ent = None if e is None else entropy.index_select(0, index)
            if use_kernel:
                grad = _kernel_grad_logits(h, y, weight, bias_acc, g)  # [chunk, vocab]
            else:
                grad = _chunk_grad_logits(h, y, weight, bias_acc, acc, t, g, e, ent)
            if grad_bias is not None:
                grad_bias += grad.sum(0, dtype=acc)
            grad = grad.to(h.dtype)  # [chunk, vocab]
            if grad_weight is not None:
                _accumulate_weight_grad(grad_weight, grad, h)
            if grad_hidden is not None:
                grad_hidden.index_copy_(0, index, grad @ weight)
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            *(None,) * 5,
        )


def fused_linear_token_logps(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    supervised_rows: Tensor | None = None,
) -> TokenTerms:
    """Per-token ``log softmax((hidden @ weight.T + bias) / temperature)[label]`` (and entropy)
    without the full logits, differentiable w.r.t. hidden, weight and bias.

    Equal to `twinkle_fn.losses.token_logps` of the projected logits (and
    `twinkle_fn.losses.token_entropy`) in value and gradient, up to float rounding, at
    O(chunk_size · vocab) transient memory; ignored tokens cost no matmul and get 0 and no
    gradient. Backward projects each chunk again (see the module docstring).

    Args:
        hidden: ``[..., hidden]`` floating point; flattened to ``[tokens, hidden]``.
        weight: ``[vocab, hidden]``, same dtype and device as `hidden`.
        labels: ``[...]`` integer token ids matching hidden's leading dims, already shifted.
        bias: optional ``[vocab]``, same dtype as `hidden`.
        ignore_index: label value of unsupervised tokens.
        temperature: the logits are divided by it (positive).
        with_entropy: also return each token's entropy.
        chunk_size: supervised tokens per chunk.
        supervised_rows: ``supervised_rows(labels, ignore_index)`` computed before the forward
            (no device sync here); None computes it (one sync on an accelerator).

    Returns:
        `TokenTerms` shaped like `labels`.

    Raises:
        ValueError: as `twinkle_fn.losses.fused_linear_cross_entropy_sum` does, and for a
            temperature that is not a positive number.
    """
    _validate(hidden, weight, bias, chunk_size)
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float)
        or temperature <= 0
    ):
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    flat, supervised_rows = _labels_and_rows(labels, hidden, weight, ignore_index, supervised_rows)
    logps, entropy = _FusedLinearLogps.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        bias,
        flat.long(),
        supervised_rows,
        chunk_size,
        float(temperature),
        with_entropy,
    )
    return TokenTerms(
        logps.view(labels.shape), entropy.view(labels.shape) if with_entropy else None
    )
