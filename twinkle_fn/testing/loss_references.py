"""References for the token and sequence losses of `twinkle_fn.losses`: each loss written again
(piecewise where the loss is a max or a clip) over a plain HF forward of a module on the
right-padded batch, in the module's dtype (float64 for a reference), returning the loss sum and
its gradients by parameter name, so a backend's fused, sharded or packed computation is checked
against an independent one.
"""

from __future__ import annotations

from typing import Any

import torch


def policy_gradient_reference(
    module: torch.nn.Module, features: list[dict[str, Any]], entropy_coef: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`twinkle_fn.losses.policy_gradient`'s loss sum over `features` (with ``advantages``) and
    its gradients by parameter name, written out over a plain forward of `module` on the
    right-padded batch, in the module's dtype (float64 for a reference)."""
    ids, labels, advantages, mask, positions = (
        torch.zeros(len(features), max(len(f["input_ids"]) for f in features), dtype=dtype)
        for dtype in (torch.int64, torch.int64, torch.float64, torch.int64, torch.int64)
    )
    labels.fill_(-100)
    for row, f in enumerate(features):
        n = len(f["input_ids"])
        ids[row, :n], labels[row, :n] = torch.tensor(f["input_ids"]), torch.tensor(f["labels"])
        advantages[row, :n] = torch.tensor(f["advantages"], dtype=torch.float64)
        mask[row, :n], positions[row, :n] = 1, torch.arange(n)
    logits = module(
        input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False
    ).logits  # [B, T, V]
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [B, T]
    entropy = -(logp.exp() * logp).sum(-1)  # [B, T]
    terms = -(advantages.to(logp.dtype) * picked) - entropy_coef * entropy
    loss_sum = (terms * (labels != -100)).sum()
    params = dict(module.named_parameters())
    grads = torch.autograd.grad(loss_sum, list(params.values()))
    return loss_sum.detach(), dict(zip(params, grads, strict=True))


def ppo_reference_terms(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    fields: dict[str, torch.Tensor],
    loss: Any,
) -> torch.Tensor:
    """The per-token terms of `twinkle_fn.losses.ppo_loss` `loss`, written out piecewise (which
    branch of the clipped surrogate is active) rather than as a max, in `logp`'s dtype.
    `logp`, `entropy` and each field ``[B, T]``; returns ``[B, T]`` (unmasked)."""
    f = {k: v.to(logp.dtype) for k, v in fields.items()}
    adv, ratio = f["advantages"], torch.exp(logp - f["old_logps"])
    high, low = 1 + loss.epsilon_high, 1 - loss.epsilon
    # the clip binds where it lowers the objective: a good token pushed above 1 + eps_high,
    # a bad one below 1 - eps; there the term is a constant (no gradient)
    binds = ((adv > 0) & (ratio > high)) | ((adv < 0) & (ratio < low))
    bound = torch.where(adv > 0, torch.full_like(ratio, high), torch.full_like(ratio, low))
    terms = torch.where(binds, -adv * bound, -adv * ratio)
    if loss.tis_cap is not None:
        terms = terms * torch.clamp(
            torch.exp(f["old_logps"] - f["rollout_logps"]), max=loss.tis_cap
        )
    if loss.beta:
        if loss.kl_estimator == "k1":
            kl = logp - f["ref_logps"]
        else:
            kl = torch.exp(f["ref_logps"] - logp) - (f["ref_logps"] - logp) - 1
        terms = terms + loss.beta * kl
    terms = terms - loss.entropy_coef * entropy
    if loss.aggregation != "token_mean":
        terms = terms * f["loss_weights"]
    return terms


def ppo_reference(
    module: torch.nn.Module, features: list[dict[str, Any]], loss: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`ppo_reference_terms`' loss sum over `features` (carrying `loss.fields`, per token or per
    sample) and its gradients by parameter name, over a plain forward of `module` on the
    right-padded batch, in the module's dtype (float64 for a reference)."""
    logp_all, labels, fields = _reference_forward(module, features, loss.fields)
    logp = logp_all.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [B, T]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [B, T]
    supervised = labels != -100
    terms = ppo_reference_terms(logp, entropy, fields, loss)
    return _with_grads(module, torch.where(supervised, terms, 0.0).sum())


def _reference_forward(
    module: torch.nn.Module, features: list[dict[str, Any]], names: Any
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """A plain forward of `module` on `features` right-padded: the log-softmax ``[B, T, V]``
    (module's dtype), labels ``[B, T]`` (-100 on padding) and the fields `names` ``[B, T]``
    float64 (a per-sample number repeated over the sample's tokens, 0 on padding)."""
    logits, labels, fields = _plain_forward(module, features, names)  # [B, T, V]
    return torch.log_softmax(logits, dim=-1), labels, fields


def _plain_forward(
    module: torch.nn.Module, features: list[dict[str, Any]], names: Any
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """`module`'s output ``logits`` on `features` right-padded, with labels and fields as
    `_reference_forward` returns them."""
    width = max(len(f["input_ids"]) for f in features)
    ids, labels, mask, positions = (
        torch.zeros(len(features), width, dtype=torch.int64) for _ in range(4)
    )
    labels.fill_(-100)
    fields = {name: torch.zeros(len(features), width, dtype=torch.float64) for name in names}
    for row, f in enumerate(features):
        n = len(f["input_ids"])
        ids[row, :n], labels[row, :n] = torch.tensor(f["input_ids"]), torch.tensor(f["labels"])
        mask[row, :n], positions[row, :n] = 1, torch.arange(n)
        for name in names:
            fields[name][row, :n] = torch.as_tensor(f[name], dtype=torch.float64)
    logits = module(
        input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False
    ).logits  # [B, T, V]
    return logits, labels, fields


def value_reference(
    module: torch.nn.Module, features: list[dict[str, Any]], clip: float | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`twinkle_fn.losses.value_loss`'s loss sum over `features` (with ``returns`` and
    ``old_values``) for a value model `module` (``[hidden] -> 1`` head), written out piecewise
    (clipped branch or not), and its gradients by parameter name, over a plain forward on the
    right-padded batch in the module's dtype (float64 for a reference)."""
    scores, labels, fields = _plain_forward(module, features, ("returns", "old_values"))
    return _with_grads(module, value_reference_sum(scores[..., 0], labels, fields, clip))


def value_reference_sum(
    values: torch.Tensor, labels: torch.Tensor, fields: dict[str, torch.Tensor], clip: float | None
) -> torch.Tensor:
    """The clipped value loss of `values` ``[B, T]`` summed over the tokens whose label is not
    -100, branch by branch: the clipped error counts only where the value left
    ``old_values +- clip`` and the clipped error is the larger."""
    returns = fields["returns"].to(values.dtype)
    error = (values - returns) ** 2
    if clip is not None:
        old = fields["old_values"].to(values.dtype)
        low, high = old - clip, old + clip
        bound = torch.where(values > high, high, low)
        outside = (values > high) | (values < low)
        clipped_error = (bound - returns) ** 2
        error = torch.where(outside & (clipped_error > error), clipped_error, error)
    return 0.5 * torch.where(labels != -100, error, 0.0).sum()


def _with_grads(
    module: torch.nn.Module, loss: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`loss` detached and its gradients by parameter name of `module`."""
    params = dict(module.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()))
    return loss.detach(), dict(zip(params, grads, strict=True))


def preference_reference_losses(
    sums: torch.Tensor, lengths: torch.Tensor, ref: torch.Tensor | None, loss: Any
) -> torch.Tensor:
    """The pair losses of `twinkle_fn.losses.dpo_loss` / `simpo_loss` `loss`, written out with
    ``log(sigmoid(.))``: `sums`, `lengths` and `ref` (DPO only) ``[2P]`` per sequence,
    interleaved chosen / rejected; returns ``[P]``."""
    if loss.kind == "simpo":
        margin = loss.beta * (sums[0::2] / lengths[0::2] - sums[1::2] / lengths[1::2])
        return -torch.log(torch.sigmoid(margin - loss.gamma))
    chosen, rejected = sums[0::2] - ref[0::2], sums[1::2] - ref[1::2]
    z = loss.beta * (chosen - rejected)
    eps = loss.label_smoothing
    return -(1 - eps) * torch.log(torch.sigmoid(z)) - eps * torch.log(torch.sigmoid(-z))


def preference_reference(
    module: torch.nn.Module, features: list[dict[str, Any]], loss: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The sum over pairs of `preference_reference_losses` for `features` (interleaved chosen /
    rejected, with ``ref_logps`` per token or ``ref_seq_logps`` per sample as `loss` reads)
    and its gradients by parameter name, over a plain forward of `module` on the right-padded
    batch, in the module's dtype (float64 for a reference)."""
    logp_all, labels, fields = _reference_forward(module, features, loss.fields)
    supervised = labels != -100
    logp = logp_all.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [B, T]
    sums = torch.where(supervised, logp, 0.0).sum(-1)  # [B]
    lengths = supervised.sum(-1).to(sums.dtype)  # [B]
    ref = None
    if "ref_logps" in fields:
        ref = torch.where(supervised, fields["ref_logps"], 0.0).sum(-1)
    elif "ref_seq_logps" in fields:
        ref = fields["ref_seq_logps"][:, 0]
    return _with_grads(module, preference_reference_losses(sums, lengths, ref, loss).sum())


def weighted_ce_reference(
    module: torch.nn.Module, features: list[dict[str, Any]]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`twinkle_fn.losses.weighted_cross_entropy`'s loss sum over `features` (with
    ``loss_scale``), ``-sum loss_scale * log p(label)`` over supervised tokens, and its
    gradients by parameter name, over a plain forward of `module` on the right-padded batch,
    in the module's dtype (float64 for a reference)."""
    logp_all, labels, fields = _reference_forward(module, features, ("loss_scale",))
    logp = logp_all.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [B, T]
    terms = -(fields["loss_scale"].to(logp.dtype) * logp)
    return _with_grads(module, torch.where(labels != -100, terms, 0.0).sum())
