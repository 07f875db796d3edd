"""The per-token terms a `twinkle_fn.losses.TokenLoss` reads, on megatron's vocab-parallel logits.

The default cross entropy never needs anything but the loss (`train.token_losses`, or the fused
loss at tp 1). Any other loss needs each token's ``log p(label)`` with its gradient, and maybe the
softmax's entropy: `token_terms` is the ``GPTModel`` output processor that computes both from the
output layer's logits, each tensor-parallel rank holding a slice of the (padded) vocabulary.

One pass of a log-softmax over the slices gives both: the max and the sum of exponentials are
reduced over the tensor-parallel group (``lse``), the target's logit comes from the rank that
holds it, and ``entropy = lse - sum_v p_v z_v``. The sums go through megatron's
``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity backward): every rank
computes the same loss from the reduced values, so each rank's slice of the logits gets exactly
its part of the gradient, and the output layer's backward sums the slices' contributions to the
hidden states as it does for megatron's own cross entropy. The max is a constant shift (the
log-softmax does not depend on it), so it is reduced without a gradient.

Columns past the real vocabulary (megatron pads it to a multiple of ``128 * tp``) are dropped
before the softmax: they take no probability mass and get a zero gradient.

Where the fused cross entropy applies (tensor-parallel size 1, see
`twinkle_fn.backends.megatron.fused_loss.fused_loss_applies`), the terms come from
`twinkle_fn.losses.fused_linear_token_logps` instead: a chunk of tokens projected at a time, so
the ``[s, b, vocab]`` logits never exist.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region
from torch import Tensor

from twinkle_fn.backends.megatron.fused_loss import fused_loss_applies
from twinkle_fn.data import IGNORE_INDEX
from twinkle_fn.losses.fused_linear_logps import fused_linear_token_logps


class TokenTerms(NamedTuple):
    """What `token_terms` hands megatron's ``loss_func`` (a plain tuple once megatron's
    ``Float16Module`` has cast it).

    ``logps``: ``[b, s]`` float32, differentiable, ``log p(label)``, 0 where the label is
    ignored. ``entropy``: ``[b, s]`` float32, differentiable, 0 where the label is ignored; None
    unless asked for.
    """

    logps: Tensor
    entropy: Tensor | None


def token_terms(
    *,
    hidden_states: Tensor,
    output_layer: torch.nn.Module,
    output_weight: Tensor | None,
    labels: Tensor,
    context: int,
    entropy: bool = False,
    config: Any = None,
    supervised_rows: Tensor | None = None,
    **unused: Any,
) -> TokenTerms:
    """``GPTModel`` output processor: the per-token log-probabilities (and entropy) of a loss.

    `hidden_states` is the last stage's ``[s, b, hidden]`` (sequence-parallel shards are gathered
    by the output layer), `labels` ``[b, s]`` (-100 ignored), `context` the unpadded vocabulary
    size, `entropy` whether to compute the entropy too, `config` the model's
    ``TransformerConfig`` (megatron passes it), `supervised_rows` those of ``labels.t()``
    computed before the forward (for the fused path; None counts them here). Returns
    `TokenTerms`.
    """
    if config is not None and fused_loss_applies(config, output_layer, hidden_states):
        weight = output_layer.weight if output_weight is None else output_weight
        terms = fused_linear_token_logps(
            hidden_states,  # [s, b, hidden]
            weight[:context].to(hidden_states.dtype),  # padding rows take no mass
            labels.t(),
            with_entropy=entropy,
            supervised_rows=supervised_rows,
        )
        return TokenTerms(terms.logps.t(), None if terms.entropy is None else terms.entropy.t())
    logits, _ = output_layer(hidden_states, weight=output_weight)  # [s, b, local_vocab]
    logps, ent = vocab_parallel_terms(logits, labels.t(), context, entropy=entropy)
    return TokenTerms(logps.t(), None if ent is None else ent.t())


def vocab_parallel_terms(
    logits: Tensor, labels: Tensor, vocab_size: int, *, entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """``log softmax(logits)[label]`` and, if `entropy`, the softmax's entropy, per token.

    `logits` ``[..., local_vocab]``: this tensor-parallel rank's slice (ids ``[rank * local,
    (rank + 1) * local)``) of the vocabulary padded past `vocab_size`; `labels` ``[...]`` (-100
    ignored). Both results are ``[...]`` float32, differentiable w.r.t. `logits`, 0 where the
    label is ignored, the same on every rank of the tensor-parallel group (a collective over
    it: every rank must call this).
    """
    group = parallel_state.get_tensor_model_parallel_group()
    tp_size, tp_rank = group.size(), group.rank()
    local = logits.shape[-1]
    start = tp_rank * local
    real = min(max(vocab_size - start, 0), local)
    z = logits[..., :real].float()  # [..., real]: this rank's columns of the real vocabulary
    # [...]; a rank holding only padding columns (z empty) adds nothing to the max or the sums
    shift = z.detach().amax(dim=-1) if real else z.new_full(z.shape[:-1], float("-inf"))
    if tp_size > 1:
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    exp = torch.exp(z - shift.unsqueeze(-1))  # [..., real]
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(-1), group)  # [...]
    lse = shift + torch.log(sum_exp)  # [...]
    supervised = labels != IGNORE_INDEX
    target = labels - start
    mine = supervised & (target >= 0) & (target < real)
    index = torch.where(mine, target, 0).unsqueeze(-1)
    picked = z.gather(-1, index).squeeze(-1) if real else z.new_zeros(labels.shape)
    target_logit = reduce_from_tensor_model_parallel_region(torch.where(mine, picked, 0.0), group)
    logps = torch.where(supervised, target_logit - lse, 0.0)
    if not entropy:
        return logps, None
    mean_logit = reduce_from_tensor_model_parallel_region((exp * z).sum(-1), group) / sum_exp
    return logps, torch.where(supervised, lse - mean_logit, 0.0)
