"""Preference losses on chosen / rejected pairs: DPO (sigmoid) and SimPO.

A batch holds pairs, its sequences interleaved ``[chosen_0, rejected_0, chosen_1, rejected_1,
...]`` (rows of a padded batch, samples of a packed one; upstream Twinkle's layout, which keeps
pairs whole under any even data-parallel split). With ``S_i`` the sum of sequence ``i``'s
log-probabilities over its supervised tokens and ``n_i`` their number, pair ``k`` (chosen ``c``,
rejected ``r``) costs::

    DPO    z = beta * ((S_c - R_c) - (S_r - R_r))
           l = -(1 - label_smoothing) * log sigmoid(z) - label_smoothing * log sigmoid(-z)
    SimPO  z = beta * (S_c / n_c - S_r / n_r) - gamma
           l = -log sigmoid(z)

``R_i`` the reference model's sum: the field ``ref_logps`` (per token, summed like ``S_i``) or,
with ``reference="sequences"``, ``ref_seq_logps`` (one number per sample, e.g. upstream's
``ref_chosen_logps``). The step's loss is the mean of ``l`` over every pair of the step (all
micro-batches and data ranks).

Design: the exact linearisation. ``l`` is not a sum of per-token terms, so it cannot pass the
token seam as it is; but its gradient is ``sum_i (dl/dS_i) * grad S_i``, and ``S_i`` is a token
sum. ``tf.fwd_bwd`` therefore runs one forward without gradients first
(``tf.token_logps``), computes every ``S_i``, the pair losses and the per-sequence weights
``w_i = dl/dS_i`` (detached, float64 autograd of the pair function), and hands them to the
backend as per-token fields of `LinearisedPairs`, the linear token loss::

    sum_t w_seq(t) * (logp_t - stop_gradient(logp_t))  +  sum over pairs of l

whose gradient is exactly the preference loss's and whose value is the pair losses' sum. Its
count is the number of pairs (an indicator field on one token of each pair), so the seam's one
division over the step makes the mean over pairs exact. Only the first pass needs whole pairs:
each data rank's batch must hold an even number of sequences. Every token's term of the second
pass depends on that token alone, so micro-batches, packing, the context-parallel zigzag and the
pipeline split it as any token loss, pairs cut in two or not, on every mesh of both backends,
with no new machinery in either. Cost: one more forward per step. (The alternative, a
sequence-level stage after the per-token one, needs pairs on one micro-batch and a reduction on
the pipeline's last stage of each backend.) With dropout on, the two passes draw different
masks and the weights are those of the first pass's sums; fine-tuning runs with dropout off,
the default of every family here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from twinkle_fn.losses.cross_entropy import LossOutput
from twinkle_fn.losses.token_loss import IGNORE_INDEX, TokenInputs

REFERENCES = ("tokens", "sequences")
PAIR_FIELDS = ("pair_weights", "pair_losses", "pairs")
"""The per-token fields `PreferenceLoss.linearise` adds for `LinearisedPairs`."""


@dataclass(frozen=True)
class LinearisedPairs:
    """The token loss of the second pass (module docstring): reads `PAIR_FIELDS`, each shaped
    like ``labels``: ``pair_weights`` (``dl/dS`` of the token's sequence), ``pair_losses`` (a
    pair's loss on one token of the pair, 0 elsewhere) and ``pairs`` (1 on that token)."""

    fields: ClassVar[tuple[str, ...]] = PAIR_FIELDS
    needs: ClassVar[frozenset[str]] = frozenset()

    def __call__(self, inputs: TokenInputs) -> LossOutput:
        """The pair losses' sum (value) with the preference loss's gradient, and the number of
        pairs (int64) of `inputs`."""
        logps, mask = inputs.logps, inputs.mask
        f = {name: inputs.fields[name].to(logps.dtype) for name in PAIR_FIELDS}
        terms = f["pair_weights"] * (logps - logps.detach()) + f["pair_losses"]  # [B, T]
        pairs = torch.where(mask, f["pairs"], 0.0).sum().round().to(torch.int64)
        # where, not a product: a non-finite value on an ignored token must not leak in
        return LossOutput(torch.where(mask, terms, 0.0).sum(), pairs)


@dataclass(frozen=True)
class PreferenceLoss:
    """DPO or SimPO over interleaved pairs (module docstring); build it with `dpo_loss` or
    `simpo_loss`. A sequence loss: ``tf.fwd_bwd`` calls `check` before any compute, then
    `linearise` on the log-probabilities of a forward without gradients. Reads ``ref_logps``
    (DPO, ``reference="tokens"``) or ``ref_seq_logps`` (DPO, ``"sequences"``)."""

    kind: str
    beta: float
    gamma: float = 0.0
    label_smoothing: float = 0.0
    reference: str = "tokens"
    needs: ClassVar[frozenset[str]] = frozenset()

    @property
    def fields(self) -> tuple[str, ...]:
        """The batch fields the first pass reads."""
        if self.kind == "simpo":
            return ()
        return ("ref_logps",) if self.reference == "tokens" else ("ref_seq_logps",)

    def pair_losses(self, sums: Tensor, lengths: Tensor, ref: Tensor | None) -> Tensor:
        """``l`` of every pair: `sums`, `lengths` and `ref` are ``[2P]`` (interleaved chosen,
        rejected; `ref` None for SimPO); returns ``[P]`` in `sums`' dtype."""
        if self.kind == "simpo":
            avg = sums / lengths
            return -F.logsigmoid(self.beta * (avg[0::2] - avg[1::2]) - self.gamma)
        ratio = sums - ref  # [2P]
        z = self.beta * (ratio[0::2] - ratio[1::2])
        eps = self.label_smoothing
        return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)

    def check(self, batch: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` unless `batch` holds whole pairs this loss can weigh: an even
        number of sequences, each with a supervised token, and (DPO) the reference field.
        Reads only the batch's host-side layout (labels, ``cu_seqlens``)."""
        labels = batch["labels"]
        seq, count = sequence_index(batch)
        what = "packed samples" if "cu_seqlens" in batch else "rows"
        if count % 2:
            raise ValueError(
                f"{self.kind}_loss: the batch has {count} {what}, an odd number; a preference "
                "batch holds pairs interleaved [chosen_0, rejected_0, chosen_1, ...], and on "
                "several data ranks each rank gets whole pairs (an even number of sequences)"
            )
        supervised = _lengths(seq.to(labels.device), labels != IGNORE_INDEX, count)
        if bool((supervised == 0).any()):
            empty = int((supervised == 0).nonzero()[0])
            raise ValueError(
                f"{self.kind}_loss: sequence {empty} of the batch ({what}) has no supervised "
                "token (every label is -100); each chosen and rejected response needs one"
            )
        for name in self.fields:
            if name not in batch:
                fix = (
                    "per-token reference log-probs (tf.token_logps of the reference, or with "
                    "disable_lora=True), as a per-token feature or batch['ref_logps'] = "
                    "out['logps']; or reference='sequences' with per-sample sums "
                    "'ref_seq_logps'"
                    if name == "ref_logps"
                    else "one number per sample: the reference's summed log-probs of it"
                )
                raise ValueError(
                    f"{self.kind}_loss reads batch field {name!r}, which is missing; {fix}"
                )

    def linearise(
        self, batch: Mapping[str, Any], logps: Tensor
    ) -> tuple[LinearisedPairs, dict[str, Any]]:
        """`LinearisedPairs` and `batch` with its `PAIR_FIELDS`, from `logps` ``[B, T]`` (the
        batch's layout, 0 on unsupervised tokens: ``tf.token_logps``' of the current weights).
        The fields are on `logps`' device, in its dtype. Raises as `check`."""
        self.check(batch)
        device = logps.device
        seq, count = sequence_index(batch)
        seq = seq.to(device)  # [B, T]
        mask = batch["labels"].to(device) != IGNORE_INDEX  # [B, T]
        lengths = _lengths(seq, mask, count).double()  # [2P]
        sums = _sums(seq, mask, logps.double(), count)  # [2P]
        ref = self._reference(batch, seq, mask, count, device)
        with torch.enable_grad():
            sums = sums.requires_grad_()
            losses = self.pair_losses(sums, lengths, ref)  # [P]
            (weights,) = torch.autograd.grad(losses.sum(), sums)  # [2P]: dl/dS_i
        # one token per pair carries its loss and counts it: the chosen's first supervised one
        first = _first_tokens(seq, mask, count)[0::2]  # [P]
        one_per_pair = torch.zeros(mask.numel(), dtype=logps.dtype, device=device)
        pair_losses = one_per_pair.clone()
        one_per_pair[first] = 1.0
        pair_losses[first] = losses.detach().to(logps.dtype)
        fields = {
            "pair_weights": torch.where(mask, weights.to(logps.dtype)[seq], 0.0),
            "pair_losses": pair_losses.view_as(mask),
            "pairs": one_per_pair.view_as(mask),
        }
        return LinearisedPairs(), {**batch, **fields}

    def _reference(
        self, batch: Mapping[str, Any], seq: Tensor, mask: Tensor, count: int, device: Any
    ) -> Tensor | None:
        """``R_i`` ``[2P]`` float64 (None for SimPO)."""
        if self.kind == "simpo":
            return None
        if self.reference == "tokens":
            return _sums(seq, mask, batch["ref_logps"].to(device).double(), count)
        per_sample = batch["ref_seq_logps"].to(device).double()  # [B, T], constant per sample
        return per_sample.reshape(-1)[_first_tokens(seq, torch.ones_like(mask), count)]


def sequence_index(batch: Mapping[str, Any]) -> tuple[Tensor, int]:
    """Which sequence each token of `batch` belongs to: ``[B, T]`` int64 (a padded batch: its
    row; a packed one: its sample in ``cu_seqlens``) on the labels' device, and the number of
    sequences. Raises ``ValueError`` for ``cu_seqlens`` that do not end at the packed length."""
    labels = batch["labels"]
    rows, width = labels.shape
    if "cu_seqlens" not in batch:
        return torch.arange(rows, device=labels.device)[:, None].expand(rows, width), rows
    cu = torch.as_tensor(batch["cu_seqlens"]).to(labels.device, torch.int64)
    if rows != 1 or int(cu[-1]) != width:
        raise ValueError(
            f"a packed batch is one row whose cu_seqlens end at its length; got labels "
            f"{tuple(labels.shape)} and cu_seqlens ending at {int(cu[-1])}"
        )
    count = cu.numel() - 1
    ids = torch.arange(count, device=labels.device)
    return torch.repeat_interleave(ids, cu[1:] - cu[:-1])[None], count


def _sums(seq: Tensor, mask: Tensor, values: Tensor, count: int) -> Tensor:
    """Per-sequence sums ``[count]`` of `values` ``[B, T]`` over the tokens in `mask`."""
    out = torch.zeros(count, dtype=values.dtype, device=values.device)
    return out.index_add(0, seq[mask], values[mask])


def _first_tokens(seq: Tensor, mask: Tensor, count: int) -> Tensor:
    """The flat index (into ``[B * T]``) of each sequence's first token in `mask`, ``[count]``
    int64 (every sequence has one: `PreferenceLoss.check`)."""
    flat = torch.arange(mask.numel(), device=mask.device).view_as(mask)  # [B, T]
    first = torch.full((count,), mask.numel(), device=mask.device, dtype=torch.int64)
    return first.scatter_reduce(0, seq[mask], flat[mask], "amin")


def _lengths(seq: Tensor, mask: Tensor, count: int) -> Tensor:
    """Supervised tokens per sequence ``[count]`` int64."""
    return torch.bincount(seq[mask], minlength=count)


def dpo_loss(
    beta: float = 0.1, *, label_smoothing: float = 0.0, reference: str = "tokens"
) -> PreferenceLoss:
    """DPO's sigmoid loss (module docstring) as a `PreferenceLoss`; `reference` says whether
    the reference comes per token (``ref_logps``) or per sequence (``ref_seq_logps``).
    Raises ``ValueError`` for a `beta` that is not a positive number, a `label_smoothing`
    outside ``[0, 0.5)``, or an unknown `reference`."""
    _check_number("dpo_loss", "beta", beta, positive=True)
    _check_number("dpo_loss", "label_smoothing", label_smoothing)
    if label_smoothing >= 0.5:
        raise ValueError(
            f"dpo_loss: label_smoothing must be in [0, 0.5) (0.5 ignores the preference), got "
            f"{label_smoothing}"
        )
    if reference not in REFERENCES:
        raise ValueError(f"dpo_loss: reference must be one of {REFERENCES}, got {reference!r}")
    return PreferenceLoss(
        "dpo", float(beta), label_smoothing=float(label_smoothing), reference=reference
    )


def simpo_loss(beta: float = 2.5, gamma: float = 0.5) -> PreferenceLoss:
    """SimPO's loss (module docstring; no reference model) as a `PreferenceLoss`. Raises
    ``ValueError`` for a `beta` that is not a positive number or a negative `gamma`."""
    _check_number("simpo_loss", "beta", beta, positive=True)
    _check_number("simpo_loss", "gamma", gamma)
    return PreferenceLoss("simpo", float(beta), gamma=float(gamma))


def _check_number(fn: str, name: str, value: Any, positive: bool = False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{fn}: {name} must be a finite number {bound}, got {value!r}")
