"""A training step's megatron-specific pieces: the loss and the pipeline schedule.

- `token_losses` is a ``GPTModel`` output processor: the output layer's vocab-parallel logits,
  with the columns that pad the vocabulary for tensor parallelism masked out, go through
  megatron-core's vocab-parallel cross entropy, so full ``[tokens, vocab]`` logits are never
  gathered. With tensor-parallel size 1 the fused loss (`twinkle_fn.backends.megatron.fused_loss`)
  replaces it and the logits never exist in full. A loss other than the default cross entropy
  (a `twinkle_fn.losses.TokenLoss`) gets each token's log-probability (and entropy) from
  `twinkle_fn.backends.megatron.token_terms` instead, and the batch fields it reads, which every
  micro-batch carries through the context-parallel split to the last pipeline stage.
- `forward_backward` runs megatron-core's schedule (1F1B when pp > 1) over the micro-batches of
  `twinkle_fn.backends.megatron.micro_batch` and returns the token-summed loss and the
  supervised-token count of this data rank, the same on every pipeline stage and
  context-parallel rank, and each micro-batch's per-token log-probabilities of the labels
  (`micro_batch.merge_logps` puts them back into the batch's layout).
- A critic (``head="value"``) ends in `twinkle_fn.backends.megatron.model.ValueHead`:
  `token_values` is its output processor (per-token values, no vocabulary), a value loss gets
  them as ``values``, and ``forward_backward`` returns them where an LM returns log-probabilities.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config
from torch import Tensor

from twinkle_fn.backends.megatron.dispatch_state import drop_dispatch_history
from twinkle_fn.backends.megatron.fused_loss import (
    FusedLoss,
    fused_loss_applies,
    fused_token_losses,
)
from twinkle_fn.backends.megatron.micro_batch import MicroBatch
from twinkle_fn.backends.megatron.packed_rotary import with_rotary
from twinkle_fn.backends.megatron.router import RouterRun
from twinkle_fn.backends.megatron.token_terms import token_terms
from twinkle_fn.data import IGNORE_INDEX
from twinkle_fn.losses import TokenInputs, TokenLoss
from twinkle_fn.losses.token_loss import apply_loss


def mask_padded_vocab_(logits: Tensor, vocab_size: int, tp_rank: int) -> Tensor:
    """Set, in place, the logits of vocabulary ids >= `vocab_size` to ``-inf``; returns `logits`.

    `logits` is ``[..., local_vocab]``: tensor-parallel rank `tp_rank`'s slice of the padded
    vocabulary (ids ``[tp_rank * local_vocab, (tp_rank + 1) * local_vocab)``). Megatron pads the
    vocabulary to a multiple of ``128 * tp``; a padding column would otherwise take softmax
    mass (its logit is 0, not -inf) and the loss would differ from the unpadded model's. The
    masked columns get a zero gradient.
    """
    local = logits.shape[-1]
    real = min(max(vocab_size - tp_rank * local, 0), local)
    if real < local:
        logits[..., real:] = float("-inf")
    return logits


def token_losses(
    *,
    hidden_states: Tensor,
    output_layer: torch.nn.Module,
    output_weight: Tensor | None,
    labels: Tensor,
    context: int,
    **unused: Any,
) -> Tensor:
    """``GPTModel`` output processor: the cross entropy of every token, ``[b, s]`` float32.

    `hidden_states` is the last stage's ``[s, b, hidden]`` (sequence-parallel shards are
    gathered by the output layer), `labels` ``[b, s]``, `context` the unpadded vocabulary size.
    Ignored labels (-100) get a finite loss that the caller masks out.
    """
    logits, _ = output_layer(hidden_states, weight=output_weight)  # [s, b, local_vocab]
    mask_padded_vocab_(logits, context, parallel_state.get_tensor_model_parallel_rank())
    losses = tensor_parallel.vocab_parallel_cross_entropy(logits, labels.t().contiguous())
    return losses.t()


def _output_losses(**kwargs: Any) -> Tensor | FusedLoss:
    """``GPTModel`` output processor: `fused_token_losses` where `fused_loss_applies` (tp 1:
    no full logits), else `token_losses`."""
    if fused_loss_applies(kwargs["config"], kwargs["output_layer"], kwargs["hidden_states"]):
        return fused_token_losses(**kwargs)
    return token_losses(**kwargs)


def _loss_sum(
    labels: Tensor, losses: Tensor | Sequence[Tensor]
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """megatron's loss_func contract with ``calculate_per_token_loss``: (sum, count, report).

    `losses` is `_output_losses`' output: `token_losses`' ``[b, s]`` or the fused loss's
    ``(loss_sum, token_losses)`` (a plain tuple once megatron's ``Float16Module`` has cast it).
    The report also holds the micro-batch's ``logps`` ``[b, s]``: the label's log-probability
    where supervised, 0 elsewhere.
    """
    supervised = labels != IGNORE_INDEX
    if isinstance(losses, Tensor):
        masked = torch.where(supervised, losses, 0.0)
        loss_sum = masked.sum()
    else:
        loss_sum, masked = losses
    num_tokens = supervised.sum()
    report = {"loss_sum": loss_sum.detach(), "num_tokens": num_tokens, "logps": -masked.detach()}
    return loss_sum, num_tokens, report


def _token_loss_sum(
    mb: MicroBatch, loss: TokenLoss, terms: Sequence[Tensor | None]
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """megatron's loss_func contract for a `TokenLoss`: `loss` of `token_terms`' output
    (``(logps, entropy)``, each ``[b, s]``) and `mb`'s labels and fields. The report is
    `_loss_sum`'s."""
    logps, entropy = terms
    out = apply_loss(loss, TokenInputs(logps, mb.labels, mb.fields, entropy))
    report = {
        "loss_sum": out.loss_sum.detach(),
        "num_tokens": out.num_tokens,
        "logps": logps.detach(),
    }
    return out.loss_sum, out.num_tokens, report


def token_values(
    *, hidden_states: Tensor, output_layer: torch.nn.Module, labels: Tensor, **unused: Any
) -> Tensor:
    """``GPTModel`` output processor of a critic: ``[b, s]`` float32 (float64 for a float64
    model) values of `output_layer` (a ``ValueHead``) at every token, differentiable, 0 where
    `labels` ``[b, s]`` is -100. `hidden_states` is the last stage's ``[s, b, hidden]``."""
    values, _ = output_layer(hidden_states)  # [s, b, 1]
    values = values[..., 0].t()  # [b, s]
    values = values.to(torch.promote_types(values.dtype, torch.float32))
    # where, not a product: a non-finite value on an ignored token must not leak in
    return torch.where(labels != IGNORE_INDEX, values, 0.0)


def _value_loss_sum(
    mb: MicroBatch, loss: TokenLoss | None, values: Tensor
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """megatron's loss_func contract for a critic: `loss` of the `token_values` ``[b, s]`` and
    `mb`'s labels and fields; without a loss (values only, no backward) a zero sum over the
    supervised tokens. The report's ``logps`` slot holds the values."""
    if loss is None:
        out_sum, count = values.new_zeros(()), (mb.labels != IGNORE_INDEX).sum()
    else:
        out = apply_loss(loss, TokenInputs(None, mb.labels, mb.fields, values=values))
        out_sum, count = out.loss_sum, out.num_tokens
    report = {"loss_sum": out_sum.detach(), "num_tokens": count, "logps": values.detach()}
    return out_sum, count, report


def _finishing(router: RouterRun, loss_func: Any, *args: Any) -> Any:
    """`loss_func`'s result, after `router` summed the micro-batch's router statistics (the
    backward of its router losses needs them)."""
    out = loss_func(*args)
    router.finish_micro_batch(out[1])
    return out


def forward_backward(
    chunks: Sequence[torch.nn.Module],
    batches: Sequence[MicroBatch],
    vocab_size: int,
    *,
    forward_only: bool = False,
    loss: TokenLoss | None = None,
    head: str = "lm",
    router: RouterRun | None = None,
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Run megatron-core's schedule over `batches`; ``(loss_sum, num_tokens, logps)``.

    `chunks` are this rank's model chunks (one: virtual pipelining is refused), wrapped by
    megatron's DDP; their config must have ``calculate_per_token_loss`` (the schedule then
    backpropagates token sums, unscaled) and no ``finalize_model_grads_func`` (the caller
    finishes the reduction: gradients stay this rank's local sums in the DDP grad buffers, or,
    with the DDP's ``overlap_grad_reduce`` and ``config.no_sync_func``, the last micro-batch's
    backward starts their reduction bucket by bucket, see `twinkle_fn.backends.megatron.grad_sync`).
    Returns a 0-d float32 loss sum and a 0-d int64 count, broadcast from the last pipeline stage and
    summed over the context-parallel ranks (each saw its chunks of the same sequences), so that
    every rank of a data shard returns the same values. ``logps`` holds each micro-batch's
    per-token ``log p(label)`` (float32, 0 where the label is ignored), broadcast from the last
    stage: ``[b, s]`` in the micro-batch's own layout, this context-parallel rank's chunks
    (`merge_logps` puts them back into the batch's layout). `loss` is the default cross entropy
    (None) or a `TokenLoss`, computed on the last stage from `token_terms` and the micro-batches'
    ``fields`` (the loss sum and count are then the loss's own). A critic (`head` ``"value"``)
    returns its per-token values in place of ``logps``, and trains `loss` (a value loss) on
    them; without a loss (forward only) its loss sum is 0. An MoE model's `router`
    (`twinkle_fn.backends.megatron.router.RouterRun`) is told of each micro-batch before its
    forward and of its loss's token count in its loss function. Raises ``ValueError`` when the
    config would normalise or reduce the gradients itself, or `batches` is empty.
    """
    config = get_model_config(chunks[0])
    if not config.calculate_per_token_loss or config.finalize_model_grads_func is not None:
        raise ValueError(
            "forward_backward needs TransformerConfig(calculate_per_token_loss=True) and no "
            "finalize_model_grads_func: the caller normalises and reduces gradients once"
        )
    if not batches:
        raise ValueError("forward_backward got no micro-batches")

    def step(data_iterator: Any, model: torch.nn.Module) -> tuple[Tensor, Any]:
        mb = next(data_iterator)
        packed = mb.packed
        if packed is not None:  # rotated from each token's position, in one pass per layer
            packed = with_rotary(packed, model, mb.position_ids)
        if head == "value":
            processor = token_values
            loss_func = functools.partial(_value_loss_sum, mb, loss)
        elif loss is None:
            processor = functools.partial(_output_losses, supervised_rows=mb.supervised_rows)
            loss_func = functools.partial(_loss_sum, mb.labels)
        else:
            processor = functools.partial(
                token_terms,
                entropy="entropy" in loss.needs,
                supervised_rows=mb.supervised_rows,
            )
            loss_func = functools.partial(_token_loss_sum, mb, loss)
        if router is not None:
            router.begin(mb.fields)
            loss_func = functools.partial(_finishing, router, loss_func)
        out = model(
            mb.input_ids,
            mb.position_ids,
            None,
            labels=mb.labels,
            packed_seq_params=packed,
            output_processor=processor,
            output_processor_context=vocab_size,
        )
        return out, loss_func

    cp_size = parallel_state.get_context_parallel_world_size()
    reports = get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=iter(batches),
        model=list(chunks),
        num_microbatches=len(batches),
        seq_length=max(mb.input_ids.shape[1] for mb in batches) * cp_size,
        micro_batch_size=max(mb.input_ids.shape[0] for mb in batches),
        forward_only=forward_only,
    )
    drop_dispatch_history(chunks)
    device = batches[0].labels.device
    sizes = [mb.labels.numel() for mb in batches]
    # One buffer: [loss_sum, num_tokens, every micro-batch's logps], so one broadcast.
    flat = torch.zeros(2 + sum(sizes), dtype=torch.float64, device=device)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        flat[0] = sum(r["loss_sum"].double() for r in reports)
        flat[1] = sum(r["num_tokens"].double() for r in reports)
        flat[2:] = torch.cat([r["logps"].reshape(-1).double() for r in reports])
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(
            flat,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
    totals = flat[:2]
    if cp_size > 1:
        # Each context-parallel rank saw its chunks of the same sequences.
        dist.all_reduce(totals, group=parallel_state.get_context_parallel_group())
    parts = flat[2:].float().split(sizes)
    logps = [p.view_as(mb.labels) for p, mb in zip(parts, batches, strict=True)]
    return totals[0].float(), totals[1].long(), logps
