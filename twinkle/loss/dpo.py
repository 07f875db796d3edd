"""Upstream's preference losses over the core's, `twinkle_fn.losses.dpo_loss` / `simpo_loss`.

A batch holds pairs interleaved ``[chosen_0, rejected_0, chosen_1, rejected_1, ...]`` (upstream's
layout). `DPOLoss` is ``dpo_loss`` (the sigmoid loss, with ``label_smoothing``; with
``reference_free`` the reference's sums are 0); `SimPOLoss` is ``simpo_loss``.

Trained by a model (``set_loss('DPOLoss', beta=0.1)``), the core's loss runs inside
``tf.fwd_bwd`` by its exact linearisation (one extra forward without gradients): the reference
log-probs come as ``forward_backward(ref_logps=...)`` (per token, e.g. the ``logps`` of
``forward_only(disable_lora=True)``) or ``ref_outputs=`` (upstream's cookbook: that output
itself); each ``forward_backward`` micro-batch must hold whole pairs, and the step's loss is
the mean over all its pairs. Called (``loss(inputs, outputs, ref_logps=...)``) a class computes
through the same core loss on given log-probs, as upstream's: ``{'loss': mean over pairs,
'num_tokens': 0}``; DPO without any reference (and not ``reference_free``) is 0.

Not provided: upstream's other ``loss_type`` (``'hinge'``, ``'ipo'``, ``'kto_pair'``) and
``sft_weight > 0`` (an NLL term on the chosen responses): the core's ``dpo_loss`` is the
sigmoid loss alone. CPO and ORPO are not in the core.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from twinkle.loss.base import Loss, LossInputError, labels_of, logps_of
from twinkle_fn.losses import PreferenceLoss, TokenInputs, dpo_loss, simpo_loss

LOSS_TYPES = ("sigmoid", "hinge", "ipo", "kto_pair")  # upstream's; the core has the first


class _PairLoss(Loss):
    """A configuration of the core's `PreferenceLoss` (`core`)."""

    _core: PreferenceLoss

    def token_loss(self) -> PreferenceLoss:
        """`core`: a sequence loss, linearised inside ``tf.fwd_bwd``."""
        return self._core

    @property
    def core(self) -> PreferenceLoss:
        """The core's loss this class trains with."""
        return self._core

    def _pairs_loss(
        self,
        core: PreferenceLoss,
        inputs: Mapping[str, Any],
        outputs: Mapping[str, Any],
        fields: Mapping[str, Tensor],
    ) -> dict[str, Any]:
        """`core`'s mean over the pairs of ``outputs['logps']`` (or ``'logits'``) ``[B, T]``,
        differentiable, with the reference `fields` (``[B, T]`` each): its linearisation's
        value and gradient."""
        labels = labels_of(inputs, self.ignore_index)  # [B, T]
        logps = logps_of(outputs, labels)  # [B, T]
        batch = {"labels": labels.to(logps.device), **fields}
        try:
            linear, batch = core.linearise(batch, logps.detach())
        except ValueError as e:
            raise LossInputError(f"{self!r}: {e}") from e
        fields = {name: batch[name] for name in linear.fields}
        out = linear(TokenInputs(logps, batch["labels"], fields))
        return {"loss": out.loss_sum / out.num_tokens, "num_tokens": 0}

    def _check_pairs(self, inputs: Mapping[str, Any]) -> Tensor:
        """``inputs``' labels ``[B, T]``; raises `LossInputError` (upstream's assertion) for
        an odd number of rows."""
        labels = labels_of(inputs, self.ignore_index)
        if labels.shape[0] % 2:
            raise LossInputError(
                f"{self!r}: {labels.shape[0]} rows; the batch size must be even (pairs "
                "interleaved [chosen_0, rejected_0, chosen_1, ...])"
            )
        return labels


class DPOLoss(_PairLoss):
    """DPO's sigmoid loss: ``-(1 - eps) log sigmoid(z) - eps log sigmoid(-z)``, ``z = beta *
    ((S_c - R_c) - (S_r - R_r))`` over sequence log-prob sums. `reference_free`: ``R = 0``.

    Raises ``ValueError`` for an unknown `loss_type` (upstream's message), `label_smoothing`
    with a type other than ``'sigmoid'`` (upstream's), the types and `sft_weight` the core
    lacks (module docstring), and what ``dpo_loss`` refuses (``beta <= 0``, ``label_smoothing``
    outside ``[0, 0.5)``).
    """

    model_inputs: ClassVar[tuple[str, ...]] = ("ref_logps", "ref_outputs", "ref_seq_logps")

    def __init__(
        self,
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        ignore_index: int = -100,
        loss_type: str = "sigmoid",
        reference_free: bool = False,
        sft_weight: float = 0.0,
        **kwargs: Any,
    ) -> None:
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"Unknown loss_type: {loss_type}")
        if label_smoothing > 0 and loss_type != "sigmoid":
            raise ValueError(
                f"label_smoothing > 0 is only defined for loss_type='sigmoid', got "
                f"loss_type={loss_type!r}; set label_smoothing=0.0 or use 'sigmoid'"
            )
        if loss_type != "sigmoid":
            raise ValueError(
                f"DPOLoss(loss_type={loss_type!r}) is not available: the core's dpo_loss is "
                "the sigmoid loss; use loss_type='sigmoid'"
            )
        if sft_weight:
            raise ValueError(
                f"DPOLoss(sft_weight={sft_weight!r}) is not available: the core's dpo_loss has "
                "no NLL term on the chosen responses; use sft_weight=0.0"
            )
        self.beta = beta
        self.label_smoothing = label_smoothing
        self.ignore_index = ignore_index
        self.loss_type = loss_type
        self.reference_free = reference_free
        reference = "sequences" if reference_free else "tokens"
        self._core = dpo_loss(beta, label_smoothing=label_smoothing, reference=reference)

    def required_inputs(self) -> tuple[str, ...]:
        """``ref_logps`` (per token), unless `reference_free`."""
        return () if self.reference_free else ("ref_logps",)

    def model_data(self, given: Mapping[str, Any], count: int) -> dict[str, Any]:
        """`given` (a training call's data for `count` samples) as the core loss's fields:
        ``ref_outputs`` (a ``forward_only`` output) gives ``ref_logps``; `reference_free`
        gives ``ref_seq_logps`` 0 per sample. Raises ``ValueError`` for a ``ref_outputs``
        without ``logps`` and for reference data with `reference_free`."""
        given = dict(given)
        ref_outputs = given.pop("ref_outputs", None)
        if ref_outputs is not None and given.get("ref_logps") is None:
            if not isinstance(ref_outputs, Mapping) or ref_outputs.get("logps") is None:
                raise ValueError(
                    f"{self!r}: ref_outputs must be a forward_only output holding 'logps', "
                    f"got {type(ref_outputs).__name__}"
                )
            given["ref_logps"] = ref_outputs["logps"]
        if self.reference_free:
            if given:
                raise ValueError(
                    f"{self!r} reads no reference; drop {sorted(given)} or set reference_free=False"
                )
            given["ref_seq_logps"] = [0.0] * count
        elif "ref_seq_logps" in given:
            raise ValueError(
                f"{self!r} trains on per-token ref_logps; pass ref_logps=... (e.g. "
                "forward_only(inputs=..., disable_lora=True)['logps'])"
            )
        return given

    def __call__(
        self,
        inputs: Mapping[str, Any],
        outputs: Mapping[str, Any],
        *,
        ref_outputs: Mapping[str, Any] | None = None,
        ref_logps: Any = None,
        ref_chosen_logps: Tensor | None = None,
        ref_rejected_logps: Tensor | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The mean DPO loss over the pairs of ``outputs['logps']`` ``[B, T]`` (or of
        ``outputs['logits']``) against ``inputs['labels']`` ``[B, T]``, as upstream's. The
        reference, tried in this order: `ref_chosen_logps` and `ref_rejected_logps` (``[B/2]``
        sequence sums); `ref_logps` (``[B, T']``, ``T' >= T``: its first ``T`` columns) or
        ``ref_outputs['logps']``; none with `reference_free`; otherwise the loss is 0. Raises
        `LossInputError` for an odd number of rows, missing labels / logps, or a row without a
        supervised token."""
        labels = self._check_pairs(inputs)
        if ref_outputs is not None and ref_logps is None:
            ref_logps = ref_outputs.get("logps")
        if ref_chosen_logps is not None and ref_rejected_logps is not None:
            sums = torch.stack([ref_chosen_logps, ref_rejected_logps], 1).reshape(-1)  # [B]
            fields = {"ref_seq_logps": sums.double()[:, None].expand(labels.shape)}
            return self._pairs_loss(self._given("sequences"), inputs, outputs, fields)
        if ref_logps is not None:
            ref = torch.as_tensor(ref_logps)
            ref = (ref.unsqueeze(0) if ref.dim() == 1 else ref)[:, : labels.shape[1]]
            return self._pairs_loss(self._given("tokens"), inputs, outputs, {"ref_logps": ref})
        if self.reference_free:
            fields = {"ref_seq_logps": torch.zeros(labels.shape, dtype=torch.float64)}
            return self._pairs_loss(self._core, inputs, outputs, fields)
        logps = logps_of(outputs, labels)
        return {"loss": logps.sum() * 0.0, "num_tokens": 0}

    def _given(self, reference: str) -> PreferenceLoss:
        """The core loss reading the reference as given to a call (``reference_free``
        ignored then, as upstream's)."""
        return dataclasses.replace(self._core, reference=reference)


class SimPOLoss(_PairLoss):
    """SimPO: ``-log sigmoid(beta * (S_c / n_c - S_r / n_r) - gamma)`` over length-normalised
    sequence log-prob sums, no reference. Raises ``ValueError`` for what ``simpo_loss``
    refuses (``beta <= 0``, ``gamma < 0``)."""

    def __init__(
        self, beta: float = 2.5, gamma: float = 0.5, ignore_index: int = -100, **kwargs: Any
    ) -> None:
        self.beta = beta
        self.gamma = gamma
        self.ignore_index = ignore_index
        self._core = simpo_loss(beta, gamma)

    def __call__(
        self, inputs: Mapping[str, Any], outputs: Mapping[str, Any], **kwargs: Any
    ) -> dict[str, Any]:
        """The mean SimPO loss over the pairs of ``outputs['logps']`` ``[B, T]`` (or of
        ``outputs['logits']``) against ``inputs['labels']``. Raises `LossInputError` for an
        odd number of rows, missing labels / logps, or a row without a supervised token."""
        self._check_pairs(inputs)
        return self._pairs_loss(self._core, inputs, outputs, {})
