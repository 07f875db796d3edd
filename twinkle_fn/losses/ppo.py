"""PPO / GRPO's clipped surrogate as a `TokenLoss`, and the weights of its aggregations.

Per supervised token ``t``, with ``r = exp(logps - old_logps)`` (the ratio of the policy being
trained to the one that sampled, as the trainer computed it before the first update)::

    pg    = max(-A * r, -A * clip(r, 1 - epsilon, 1 + epsilon_high)) * w_tis
    term  = pg + beta * KL(logps, ref_logps) - entropy_coef * entropy

``A`` the ``advantages`` field. ``w_tis = min(exp(old_logps - rollout_logps), tis_cap)``
(truncated importance sampling, only with `tis_cap`): the rollout engine (vLLM, a plain HF model
in bf16...) sampled with probabilities a little unlike the trainer's; the capped ratio of the
trainer's to the rollout's probabilities reweights each token, and the cap bounds the variance.
The KL to the reference policy uses the ``"k1"`` estimator ``logps - ref_logps`` or the
``"k3"`` one ``exp(ref_logps - logps) - (ref_logps - logps) - 1`` (non-negative, unbiased).

Aggregation. The seam divides the token sum by the supervised-token count of the whole step
(every micro-batch and data rank), exactly. Every other linear aggregation is that token mean
of weighted terms, ``sum_t weight_t * term_t / N``: `aggregation_weights` gives each sequence
its weight from the supervised-token lengths of the whole step's sequences (``N`` their sum,
``G`` their number), a per-sample number that collation broadcasts to the sample's tokens as
the field ``loss_weights``:

- ``"token_mean"``: no field; every token weighs 1 (DAPO's token-level mean).
- ``"seq_mean_token_mean"``: ``N / (G * len_s)``, so the step's loss is the mean over sequences
  of each sequence's token mean (the original GRPO).
- ``"dr_grpo"``: ``N / (G * max_tokens)``, a constant normaliser ``G * max_tokens`` (Dr. GRPO:
  no length bias).

Because the weight is per token and the count stays the token count, the normalisation stays
exact however a backend splits the batch (micro-batches, data ranks, context-parallel chunks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from twinkle_fn.losses.cross_entropy import LossOutput
from twinkle_fn.losses.token_loss import TokenInputs

KL_ESTIMATORS = ("k1", "k3")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "dr_grpo")


@dataclass(frozen=True)
class ClippedSurrogate:
    """The PPO / GRPO loss of the module docstring (build it with `ppo_loss`, which checks the
    arguments). Reads ``advantages`` and ``old_logps``; ``ref_logps`` when ``beta > 0``;
    ``rollout_logps`` with a ``tis_cap``; ``loss_weights`` unless the aggregation is
    ``"token_mean"``. Needs ``entropy`` when ``entropy_coef`` is not 0. Counts the supervised
    tokens."""

    epsilon: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    tis_cap: float | None = None
    aggregation: str = "token_mean"

    @property
    def fields(self) -> tuple[str, ...]:
        """The batch fields this configuration reads."""
        out = ["advantages", "old_logps"]
        if self.beta:
            out.append("ref_logps")
        if self.tis_cap is not None:
            out.append("rollout_logps")
        if self.aggregation != "token_mean":
            out.append("loss_weights")
        return tuple(out)

    @property
    def needs(self) -> frozenset[str]:
        """``{"entropy"}`` when the entropy bonus is on, else nothing."""
        return frozenset({"entropy"}) if self.entropy_coef else frozenset()

    def __call__(self, inputs: TokenInputs) -> LossOutput:
        """`LossOutput` of the loss over `inputs`: the token sum of the (weighted) terms, in
        logps' dtype (fields are cast to it), and the supervised-token count. Raises
        ``ValueError`` for a missing field or one not shaped like ``labels`` ``[B, T]``."""
        self._check(inputs)
        logps, mask = inputs.logps, inputs.mask
        f = {name: inputs.fields[name].to(logps.dtype) for name in self.fields}
        advantages = f["advantages"]
        ratio = torch.exp(logps - f["old_logps"])  # [B, T]
        clipped = ratio.clamp(1.0 - self.epsilon, 1.0 + self.epsilon_high)
        terms = torch.maximum(-advantages * ratio, -advantages * clipped)
        if self.tis_cap is not None:
            # fields carry no gradient: the weight is a constant per token
            terms = terms * torch.exp(f["old_logps"] - f["rollout_logps"]).clamp(max=self.tis_cap)
        if self.beta:
            log_ratio = f["ref_logps"] - logps
            kl = -log_ratio if self.kl_estimator == "k1" else log_ratio.exp() - log_ratio - 1
            terms = terms + self.beta * kl
        if self.entropy_coef:
            terms = terms - self.entropy_coef * inputs.entropy
        if self.aggregation != "token_mean":
            terms = terms * f["loss_weights"]
        # where, not a product: a non-finite value on an ignored token must not leak in
        return LossOutput(torch.where(mask, terms, 0.0).sum(), mask.sum())

    def _check(self, inputs: TokenInputs) -> None:
        shape = tuple(inputs.labels.shape)
        for name in self.fields:
            value = inputs.fields.get(name)
            if value is None:
                raise ValueError(
                    f"the loss {self!r} reads field {name!r}, which the inputs lack; {_FIX[name]}"
                )
            if tuple(value.shape) != shape:
                raise ValueError(
                    f"the loss {self!r}: field {name!r} is shaped {tuple(value.shape)}, labels "
                    f"{shape}; give one number per token (aligned with the shifted labels) or "
                    "one per sample"
                )
        if self.entropy_coef and inputs.entropy is None:
            raise ValueError(f"the loss {self!r} needs the entropy, which the inputs lack")


_FIX = {
    "advantages": "give every feature 'advantages' (e.g. twinkle_fn.losses.group_advantages)",
    "old_logps": "give every feature the per-token 'old_logps' of tf.token_logps before updating",
    "ref_logps": "beta > 0 needs per-token 'ref_logps' of the reference (tf.token_logps with "
    "disable_lora=True, or of a frozen copy), or set beta=0",
    "rollout_logps": "tis_cap needs per-token 'rollout_logps' from the sampler, or set "
    "tis_cap=None",
    "loss_weights": "give every feature 'loss_weights' from aggregation_weights, or use "
    "aggregation='token_mean'",
}


def ppo_loss(
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    *,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    tis_cap: float | None = None,
    aggregation: str = "token_mean",
) -> ClippedSurrogate:
    """The clipped surrogate of PPO / GRPO (see the module docstring) as a `TokenLoss`.

    `epsilon_high` defaults to `epsilon` (symmetric clipping; DAPO's clip-higher sets it
    larger). Raises ``ValueError`` for an `epsilon` / `epsilon_high` not in ``(0, inf)`` (and
    `epsilon` < 1), a negative or non-finite `beta` or `entropy_coef`, a `tis_cap` that is not
    a positive number, or a `kl_estimator` / `aggregation` outside `KL_ESTIMATORS` /
    `AGGREGATIONS`.
    """
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    for name, value in (("epsilon", epsilon), ("epsilon_high", epsilon_high)):
        if not _real(value) or value <= 0:
            raise ValueError(f"ppo_loss: {name} must be a positive number, got {value!r}")
    if epsilon >= 1:
        raise ValueError(
            f"ppo_loss: epsilon must be below 1 (the ratio is positive), got {epsilon}"
        )
    for name, value in (("beta", beta), ("entropy_coef", entropy_coef)):
        if not _real(value) or value < 0:
            raise ValueError(f"ppo_loss: {name} must be a finite number >= 0, got {value!r}")
    if tis_cap is not None and (not _real(tis_cap) or tis_cap <= 0):
        raise ValueError(f"ppo_loss: tis_cap must be a positive number or None, got {tis_cap!r}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(
            f"ppo_loss: kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}"
        )
    if aggregation not in AGGREGATIONS:
        raise ValueError(
            f"ppo_loss: aggregation must be one of {AGGREGATIONS}, got {aggregation!r}"
        )
    return ClippedSurrogate(
        float(epsilon),
        float(epsilon_high),
        float(beta),
        kl_estimator,
        float(entropy_coef),
        None if tis_cap is None else float(tis_cap),
        aggregation,
    )


def aggregation_weights(
    lengths: Sequence[int], aggregation: str, max_tokens: int | None = None
) -> list[float]:
    """Per-sequence ``loss_weights`` that make the token mean `aggregation` (module docstring).

    `lengths`: the supervised-token count of every sequence of one optimizer step (all its
    micro-batches and data ranks), in order; returns one weight per sequence (give it to the
    feature as ``loss_weights``; collation broadcasts it, in float32, to the sequence's
    tokens). `max_tokens` (``"dr_grpo"`` only): the constant per-sequence normaliser, the
    generation budget. Raises ``ValueError`` for no lengths, a length below 1, an unknown
    `aggregation`, or ``"dr_grpo"`` without a positive `max_tokens`.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(
            f"aggregation_weights: aggregation must be one of {AGGREGATIONS}, got {aggregation!r}"
        )
    lengths = list(lengths)
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
        raise ValueError(
            f"aggregation_weights: lengths must be supervised-token counts >= 1, got {lengths!r}"
        )
    total, count = sum(lengths), len(lengths)
    if aggregation == "token_mean":
        return [1.0] * count
    if aggregation == "seq_mean_token_mean":
        return [total / (count * n) for n in lengths]
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(
            f"aggregation_weights: 'dr_grpo' needs max_tokens, a positive int (the generation "
            f"budget), got {max_tokens!r}"
        )
    return [total / (count * max_tokens)] * count


def _real(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
