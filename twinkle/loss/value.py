"""PPO's clipped value loss for a critic, over the core's `twinkle_fn.losses.value_loss`.

Upstream Twinkle has no critic loss yet; `PPOValueLoss` follows its losses' conventions. Trained
by a value model (``TransformersValueModel`` / ``MegatronValueModel``, whose default loss it is,
or ``set_loss('PPOValueLoss', clip=0.2)``), it reads the ``forward_backward`` arguments
``returns`` and, with a clip, ``old_values`` (the critic's ``forward_only`` values before the
update), per sample or per token as `twinkle.loss.base.align_rows` takes them; the token sums
of every call of a step are normalised once over all their supervised tokens (the core's seam).
Called (``loss(inputs, outputs, returns=..., old_values=...)``) it gives the token mean of
``outputs['values']`` against ``inputs['labels']``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from twinkle.loss.base import Loss, LossInputError, align_rows, labels_of
from twinkle_fn.losses import TokenInputs, ValueLoss, value_loss


class PPOValueLoss(Loss):
    """``0.5 * max((V - R)^2, (clip(V, V_old - clip, V_old + clip) - R)^2)`` per supervised
    token, token mean (verl's critic loss; ``clip=None``: ``0.5 * (V - R)^2``, no
    ``old_values``). Raises ``ValueError`` for a `clip` that is not a positive number or None."""

    require_logps: ClassVar[bool] = False
    model_inputs: ClassVar[tuple[str, ...]] = ("returns", "old_values")

    def __init__(self, clip: float | None = 0.2, ignore_index: int = -100) -> None:
        self.clip = clip
        self.ignore_index = ignore_index
        self._core = value_loss(clip)  # checks clip now, before any model is built

    @property
    def core(self) -> ValueLoss:
        """The core's loss this class trains with."""
        return self._core

    def token_loss(self) -> ValueLoss:
        """`core`."""
        return self._core

    def required_inputs(self) -> tuple[str, ...]:
        """``returns``, and ``old_values`` with a clip."""
        return self._core.fields

    def __call__(
        self,
        inputs: Mapping[str, Any],
        outputs: Mapping[str, Any],
        *,
        returns: Any = None,
        old_values: Any = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """``{'loss': 0-d token mean, 'num_tokens': 0}`` of ``outputs['values']`` ``[B, T]``
        against ``inputs['labels']`` ``[B, T]`` (0: the loss is already a mean), `returns` and
        `old_values` per sample or per token. Raises `LossInputError` without labels, values,
        `returns`, or (with a clip) `old_values`; ``ValueError`` for misaligned data."""
        labels = labels_of(inputs, self.ignore_index)
        values = outputs.get("values")
        if values is None:
            raise LossInputError("outputs must contain 'values' [batch, seq] (a value model's)")
        values = torch.as_tensor(values)
        masks = list(labels != -100)
        given = {"returns": returns, "old_values": old_values}
        fields = {}
        for name in self._core.fields:
            if given[name] is None:
                raise LossInputError(f"{self!r} needs {name}=..., per sample or per token")
            fields[name] = torch.stack(align_rows(name, given[name], masks, values.dtype, self))
        out = self._core(TokenInputs(None, labels, fields, values=values))
        return {"loss": out.loss_sum / out.num_tokens.clamp(min=1), "num_tokens": 0}
