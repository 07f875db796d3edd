"""Upstream's GRPO family over the core's clipped surrogate, `twinkle_fn.losses.ppo_loss`.

Each class is one configuration of ``ppo_loss``; they differ in how token terms aggregate:

- `GRPOLoss`: mean over sequences of each sequence's token mean (``seq_mean_token_mean``);
- `BNPOLoss`: mean over every token of the batch (``token_mean``);
- `DRGRPOLoss`: token sum over ``batch * max_completion_length`` (``dr_grpo``);
- `PPOLoss` (no upstream class of that name): every option of ``ppo_loss``, token mean by
  default -- asymmetric clip, k1 / k3 KL, entropy bonus, truncated importance sampling.

KL to the reference is k3 (``exp(ref - logp) - (ref - logp) - 1``, upstream's) times ``beta``.

Trained by a model (``set_loss``), a class reads the ``forward_backward`` arguments
``advantages`` and ``old_logps`` (and ``ref_logps`` when ``beta > 0``, ``rollout_logps`` with a
``tis_cap``); the sequence weights of its aggregation are taken over the sequences of each
``forward_backward`` call on every data rank, and the token sums of every call of a step are
normalised once, exactly (the core's seam). One call per step (upstream's GRPO cookbook) is
thus the sequence mean over the step's sequences; with gradient accumulation the calls weigh
by their tokens, where upstream averages the calls' means.

Called (``loss(inputs, outputs, advantages=..., old_logps=..., ref_logps=...)``) a class
behaves as upstream's: without ``advantages`` the loss is 0 (a forward that only harvests
``logps``); without ``old_logps`` the ratio is 1 (on-policy); without ``ref_logps`` no KL is
added whatever ``beta`` (a model's ``forward_backward`` refuses that instead). One difference:
upstream clamps the log-ratio to [-20, 20] before ``exp``; the core does not, so the two differ
only where the trained and the sampling policies' log-probs of a token are 20 nats apart.
Not provided: GSPO (sequence-level ratio), SAPO (soft gate), CISPO (a detached clipped weight
on ``logp``): the core's ``ppo_loss`` is a per-token clipped surrogate and expresses none of
them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from twinkle.loss.base import Loss, LossInputError, align_rows, labels_of, logps_of
from twinkle_fn.losses import ClippedSurrogate, TokenInputs, aggregation_weights, ppo_loss


class _ClippedLoss(Loss):
    """One configuration of ``ppo_loss`` (module docstring); `core` is that loss."""

    model_inputs: ClassVar[tuple[str, ...]] = (
        "advantages",
        "old_logps",
        "ref_logps",
        "rollout_logps",
    )

    def __init__(
        self,
        epsilon: float,
        epsilon_high: float | None,
        beta: float,
        entropy_coef: float,
        ignore_index: int,
        *,
        kl_estimator: str = "k3",
        tis_cap: float | None = None,
        aggregation: str,
        max_completion_length: int | None = None,
    ) -> None:
        self.epsilon = epsilon
        self.epsilon_high = epsilon if epsilon_high is None else epsilon_high
        self.beta = beta
        self.entropy_coef = entropy_coef
        self.ignore_index = ignore_index
        self.max_completion_length = max_completion_length
        self.require_entropy = bool(entropy_coef)
        # ppo_loss checks every argument now, before any model is built
        self._core = ppo_loss(
            epsilon,
            epsilon_high,
            beta=beta,
            kl_estimator=kl_estimator,
            entropy_coef=entropy_coef,
            tis_cap=tis_cap,
            aggregation=aggregation,
        )
        if aggregation == "dr_grpo":
            aggregation_weights([1], aggregation, max_completion_length)  # checks the budget

    @property
    def core(self) -> ClippedSurrogate:
        """The core's loss this class trains with."""
        return self._core

    def token_loss(self) -> ClippedSurrogate:
        """`core`."""
        return self._core

    def required_inputs(self) -> tuple[str, ...]:
        """``advantages``, ``old_logps``; ``ref_logps`` when ``beta > 0``; ``rollout_logps``
        with a ``tis_cap``."""
        return tuple(f for f in self._core.fields if f != "loss_weights")

    def row_weights(self, lengths: Sequence[int]) -> list[float] | None:
        """`aggregation_weights` of `lengths` (samples without a supervised token weigh 0), or
        None for the token mean."""
        if self._core.aggregation == "token_mean":
            return None
        kept = [n for n in lengths if n > 0]
        if not kept:
            return [0.0] * len(lengths)
        weights = iter(
            aggregation_weights(kept, self._core.aggregation, self.max_completion_length)
        )
        return [next(weights) if n > 0 else 0.0 for n in lengths]

    def __call__(
        self,
        inputs: Mapping[str, Any],
        outputs: Mapping[str, Any],
        *,
        old_logps: Any = None,
        ref_logps: Any = None,
        advantages: Any = None,
        rollout_logps: Any = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The loss of ``outputs['logps']`` ``[B, T]`` (or of ``outputs['logits']``) against
        ``inputs['labels']`` ``[B, T]``, as upstream's: ``{'loss': 0-d mean, 'num_tokens': 0}``
        (0: the loss is already a mean). `advantages`, `old_logps`, `ref_logps`,
        `rollout_logps`: per sample or per token, as `align_rows` takes them. See the module
        docstring for what a missing one means. Raises `LossInputError` without labels, logps
        or, with ``entropy_coef``, ``outputs['entropies']``; ``ValueError`` for misaligned
        data."""
        labels = labels_of(inputs, self.ignore_index)
        logps = logps_of(outputs, labels)  # [B, T]
        if advantages is None:
            return {"loss": logps.sum() * 0.0, "num_tokens": 0}
        masks = list(labels != -100)
        given = {"advantages": advantages, "old_logps": old_logps, "ref_logps": ref_logps}
        given["rollout_logps"] = rollout_logps
        core = self._core if ref_logps is not None else dataclasses.replace(self._core, beta=0.0)
        fields = {}
        for name in core.fields:
            if name == "old_logps" and old_logps is None:
                fields[name] = logps.detach()
            elif name == "loss_weights":
                fields[name] = self._weights(masks, logps.dtype)
            elif given[name] is None:
                raise LossInputError(f"{self!r} needs {name}=..., per sample or per token")
            else:
                fields[name] = torch.stack(align_rows(name, given[name], masks, logps.dtype, self))
        entropy = outputs.get("entropies") if self.entropy_coef else None
        if self.entropy_coef and entropy is None:
            raise LossInputError(
                f"{self!r}: entropy_coef > 0 needs outputs['entropies'] [batch, seq]"
            )
        out = core(TokenInputs(logps, labels, fields, entropy))
        loss = out.loss_sum / out.num_tokens.clamp(min=1)
        if core.aggregation != "token_mean":
            # upstream's sequence mean / dr_grpo divide by every row, empty ones too
            loss = loss * sum(bool(m.any()) for m in masks) / len(masks)
        return {"loss": loss, "num_tokens": 0}

    def _weights(self, masks: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
        """``[B, T]`` `row_weights` of the rows' supervised tokens, on those tokens."""
        weights = self.row_weights([int(m.sum()) for m in masks]) or [1.0] * len(masks)
        return torch.stack([m.to(dtype) * w for m, w in zip(masks, weights, strict=True)])


class GRPOLoss(_ClippedLoss):
    """Upstream's GRPO loss: clipped surrogate (`epsilon`, `epsilon_high` default `epsilon`),
    k3 KL times `beta`, entropy bonus `entropy_coef`, mean over sequences of token means.
    Raises ``ValueError`` for arguments ``ppo_loss`` refuses."""

    _AGGREGATION: ClassVar[str] = "seq_mean_token_mean"

    def __init__(
        self,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.0,
        entropy_coef: float = 0.0,
        ignore_index: int = -100,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            epsilon, epsilon_high, beta, entropy_coef, ignore_index, aggregation=self._AGGREGATION
        )


class BNPOLoss(GRPOLoss):
    """`GRPOLoss` normalised by every supervised token of the batch (the token mean)."""

    _AGGREGATION: ClassVar[str] = "token_mean"


class DRGRPOLoss(_ClippedLoss):
    """`GRPOLoss` summed over tokens and divided by ``batch * max_completion_length``
    (Dr. GRPO: no length bias). Raises ``ValueError`` for a `max_completion_length` that is
    not a positive int, and as `GRPOLoss`."""

    def __init__(
        self,
        epsilon: float = 0.2,
        beta: float = 0.0,
        max_completion_length: int = 1024,
        ignore_index: int = -100,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            epsilon,
            kwargs.get("epsilon_high"),
            beta,
            kwargs.get("entropy_coef", 0.0),
            ignore_index,
            aggregation="dr_grpo",
            max_completion_length=max_completion_length,
        )


class PPOLoss(_ClippedLoss):
    """Every option of the core's ``ppo_loss``: `kl_estimator` ``'k1'`` / ``'k3'``,
    `tis_cap` (reads ``rollout_logps``), `aggregation` ``'token_mean'`` (default),
    ``'seq_mean_token_mean'`` or ``'dr_grpo'`` (with `max_completion_length`). Raises
    ``ValueError`` for arguments ``ppo_loss`` refuses."""

    def __init__(
        self,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.0,
        entropy_coef: float = 0.0,
        ignore_index: int = -100,
        *,
        kl_estimator: str = "k3",
        tis_cap: float | None = None,
        aggregation: str = "token_mean",
        max_completion_length: int | None = None,
    ) -> None:
        super().__init__(
            epsilon,
            epsilon_high,
            beta,
            entropy_coef,
            ignore_index,
            kl_estimator=kl_estimator,
            tis_cap=tis_cap,
            aggregation=aggregation,
            max_completion_length=max_completion_length,
        )
        self.kl_estimator = kl_estimator
        self.tis_cap = tis_cap
        self.aggregation = aggregation
