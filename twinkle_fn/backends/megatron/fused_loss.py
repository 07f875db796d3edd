"""The megatron backend's loss with the output layer fused into a chunked cross entropy.

`token_losses` (``twinkle_fn.backends.megatron.train``) computes the output layer's ``[s, b, vocab]``
logits and runs megatron-core's vocab-parallel cross entropy over float32 copies of them: at
seq 2048 x batch 8 and a 152k vocabulary that is ~15 GB of logits and a dozen full passes
over them per micro-batch. When the vocabulary is not split (tensor-parallel size 1) nothing
needs the full logits: `fused_token_losses` hands the last stage's hidden states and the output
weight to `twinkle_fn.losses.fused_linear_cross_entropy_sum`, which projects a chunk of tokens
at a time and computes each chunk's loss and gradients at once (a Triton kernel on CUDA).

`fused_loss_applies` says when the fused loss replaces `token_losses` (``GPTModel`` output
processors both): tensor-parallel size 1 and megatron's plain bias-free output layer.
Everything else (tp > 1, whose logits are split over ranks; deferred embedding weight
gradients) keeps `token_losses`. The two agree to float rounding (``fused_loss_test``), so
there is no switch: megatron's ``cross_entropy_loss_fusion`` stays megatron's own (its
``GPTModel(labels=...)`` loss), which this backend does not use.

The padded vocabulary (megatron pads it to a multiple of ``128 * tp``) is handled by slicing the
output weight to the real vocabulary: padding rows take no softmax mass and get a zero gradient,
as `train.mask_padded_vocab_` gives them on the logits path.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer import TransformerConfig
from torch import Tensor

from twinkle_fn.data import IGNORE_INDEX
from twinkle_fn.losses import fused_linear_cross_entropy_sum
from twinkle_fn.losses.fused_linear_ce import DEFAULT_CHUNK_SIZE


class FusedLoss(NamedTuple):
    """What `fused_token_losses` hands megatron's ``loss_func``.

    ``loss_sum``: 0-d float32 (float64 for float64 inputs), differentiable: the cross entropy
    summed over the supervised tokens. ``token_losses``: ``[b, s]``, detached, same dtype: each
    token's cross entropy, 0 where the label is ignored.
    """

    loss_sum: Tensor
    token_losses: Tensor


def fused_loss_applies(
    config: TransformerConfig, output_layer: torch.nn.Module, hidden_states: Tensor
) -> bool:
    """Whether `fused_token_losses` computes this micro-batch's loss (else `token_losses`).

    True iff the tensor-parallel size is 1 (the whole vocabulary is on this rank),
    `output_layer` is megatron's ``ColumnParallelLinear`` with no bias,
    ``config.defer_embedding_wgrad_compute`` is off (it computes the output weight's gradient
    outside autograd) and `hidden_states` are floating point.
    """
    return (
        parallel_state.get_tensor_model_parallel_world_size() == 1
        and isinstance(output_layer, tensor_parallel.ColumnParallelLinear)
        and output_layer.bias is None
        and not config.defer_embedding_wgrad_compute
        and hidden_states.dtype.is_floating_point
    )


def fused_token_losses(
    *,
    hidden_states: Tensor,
    output_layer: torch.nn.Module,
    output_weight: Tensor | None,
    labels: Tensor,
    context: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    supervised_rows: Tensor | None = None,
    **unused: Any,
) -> FusedLoss:
    """``GPTModel`` output processor: the token-summed loss and per-token losses, no full logits.

    `hidden_states` is the last stage's ``[s, b, hidden]`` (this context-parallel rank's chunks,
    in the order of `labels`), `labels` ``[b, s]`` (-100 ignored), `output_weight` the shared
    embedding when the embeddings are tied (else `output_layer`'s own weight is used), `context`
    the unpadded vocabulary size. The weight is cast to the hidden states' dtype when they
    differ (the autocast of megatron's output layer). With grad mode off (evaluation) no
    gradient work is done. `chunk_size` supervised tokens are projected at a time.
    `supervised_rows`: `twinkle_fn.losses.supervised_rows` of ``labels.t()``, computed before the
    forward (no mid-step device sync); None counts them here.

    Returns `FusedLoss`. Raises ``ValueError`` when `context` exceeds the output layer's rows,
    and as `twinkle_fn.losses.fused_linear_cross_entropy_sum` does (a label outside the
    vocabulary, on CPU).
    """
    weight = output_layer.weight if output_weight is None else output_weight
    if weight is None:
        raise ValueError(
            "the output layer has no weight of its own (tied embeddings) and no output_weight "
            "was passed; pass the shared embedding weight as output_weight"
        )
    if context > weight.shape[0]:
        raise ValueError(
            f"vocabulary size {context} exceeds the output layer's {weight.shape[0]} rows; "
            "pass the model's unpadded vocabulary size as the output processor context"
        )
    # Rows past the real vocabulary pad it for tensor parallelism: they must take no softmax
    # mass. A view, so the padding rows of the parameter get a zero gradient.
    weight = weight[:context].to(hidden_states.dtype)
    hidden = hidden_states
    if not torch.is_grad_enabled():
        # The fused loss computes gradients in forward whenever its inputs require them.
        hidden, weight = hidden.detach(), weight.detach()
    out = fused_linear_cross_entropy_sum(
        hidden,  # [s, b, hidden]
        weight,  # [vocab, hidden]
        labels.t(),  # [s, b], matching hidden's layout
        ignore_index=IGNORE_INDEX,
        chunk_size=chunk_size,
        return_token_losses=True,
        supervised_rows=supervised_rows,
    )
    return FusedLoss(out.loss_sum, out.token_losses.t())
