"""Token-sum cross entropy over already-shifted labels.

A loss here is a *sum* over supervised tokens plus the *count* of those tokens. The caller divides
once, by the count summed over every micro-batch and every data-parallel rank, so k micro-batches
of n tokens give exactly the update of one batch of k·n tokens, however the padding falls.

Labels are already shifted (``labels[..., t]`` is the target of ``logits[..., t, :]``, as upstream
Twinkle's templates produce them); nothing here shifts again. ``ignore_index`` marks tokens that
are not supervised (prompt, padding).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class LossOutput(NamedTuple):
    """A token-sum loss and the number of tokens it sums over.

    ``loss_sum``: 0-d, differentiable; float32 (float64 when the inputs are float64).
    ``num_tokens``: 0-d int64 on the same device, the number of labels != ignore_index.
    """

    loss_sum: Tensor
    num_tokens: Tensor


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype softmax and sums run in: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def validate_labels(
    labels: Tensor, leading_shape: torch.Size, vocab_size: int, ignore_index: int, *, against: str
) -> None:
    """Check that `labels` can index a vocabulary of `vocab_size` for inputs of `leading_shape`.

    `against` names the tensor whose leading dims the labels must match (for the message).
    The range check reduces over the labels and reads the answer on the host, so it runs only
    for CPU labels, where that costs no device sync. On an accelerator an out-of-range label is
    still not silent: the gather that picks the target logit fails with a device-side bounds
    assertion.

    Raises:
        ValueError: labels are not an integer tensor, their shape is not `leading_shape`, or
            (CPU only) a label other than `ignore_index` lies outside ``[0, vocab_size)``.
    """
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ValueError(
            f"labels must be an integer tensor of token ids, got dtype {labels.dtype}; "
            "convert with labels.long()"
        )
    if labels.shape != leading_shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal the leading dims of {against} "
            f"{tuple(leading_shape)} (labels are already shifted: one target per position)"
        )
    if labels.device.type != "cpu":
        return
    supervised = labels != ignore_index
    out_of_range = supervised & ((labels < 0) | (labels >= vocab_size))
    if bool(out_of_range.any()):
        position = tuple(int(i) for i in out_of_range.nonzero()[0])
        raise ValueError(
            f"labels{list(position)} = {int(labels[position])} is outside the vocabulary "
            f"[0, {vocab_size}) and is not ignore_index ({ignore_index})"
        )


def token_logps(logits: Tensor, labels: Tensor, ignore_index: int = -100) -> Tensor:
    """Per-token ``log p(label)``: 0 where the label is `ignore_index`.

    Args:
        logits: ``[..., vocab]``, any float dtype; the log-softmax runs in float32
            (float64 stays float64).
        labels: ``[...]`` integer token ids, already shifted.
        ignore_index: label value of unsupervised tokens.

    Returns:
        ``[...]`` float32 (float64 for float64 logits), differentiable w.r.t. `logits`.

    Raises:
        ValueError: logits are not floating point or have no vocab dim; labels are invalid
            (see `validate_labels`).
    """
    if not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be floating point, got dtype {logits.dtype}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., vocab] with vocab > 0, got {tuple(logits.shape)}")
    validate_labels(
        labels, logits.shape[:-1], logits.shape[-1], ignore_index, against="logits [..., vocab]"
    )
    logits = logits.to(accumulation_dtype(logits.dtype))
    supervised = labels != ignore_index
    # gather needs an in-range index even where the result is masked out
    targets = torch.where(supervised, labels, 0).long()
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (picked - torch.logsumexp(logits, dim=-1)).masked_fill(~supervised, 0.0)


def cross_entropy_sum(logits: Tensor, labels: Tensor, ignore_index: int = -100) -> LossOutput:
    """Sum of per-token cross entropy over supervised tokens, and their count.

    Args:
        logits: ``[..., vocab]``, any float dtype (upcast to float32 for the log-softmax).
        labels: ``[...]`` integer token ids, already shifted; `ignore_index` marks unsupervised
            tokens.

    Returns:
        ``LossOutput(loss_sum, num_tokens)``; both 0 when every label is ignored.

    Raises:
        ValueError: as `token_logps`.
    """
    loss_sum = -token_logps(logits, labels, ignore_index).sum()
    return LossOutput(loss_sum, (labels != ignore_index).sum())
