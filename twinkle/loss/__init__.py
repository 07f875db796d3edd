"""Upstream Twinkle's losses (`twinkle.loss`) over the core's loss functions.

Each class can be called as upstream's (``loss(inputs, outputs, **kw)``) and given to a model's
``set_loss`` (a class, an instance, or a name: the class name or upstream's short name, e.g.
``set_loss('GRPOLoss', epsilon=0.2, beta=0.04)``). `make_loss` resolves them.
"""

from __future__ import annotations

from typing import Any

from twinkle.loss.base import Loss, LossInputError
from twinkle.loss.cross_entropy import CrossEntropyLoss
from twinkle.loss.dpo import DPOLoss, SimPOLoss
from twinkle.loss.grpo import BNPOLoss, DRGRPOLoss, GRPOLoss, PPOLoss
from twinkle.loss.value import PPOValueLoss

LOSSES: dict[str, type[Loss]] = {
    cls.__name__: cls
    for cls in (
        CrossEntropyLoss,
        GRPOLoss,
        BNPOLoss,
        DRGRPOLoss,
        PPOLoss,
        DPOLoss,
        SimPOLoss,
        PPOValueLoss,
    )
}
# upstream's `torch_loss_mapping` names
LOSSES.update(
    cross_entropy=CrossEntropyLoss,
    grpo=GRPOLoss,
    bnpo=BNPOLoss,
    dr_grpo=DRGRPOLoss,
    ppo=PPOLoss,
    dpo=DPOLoss,
    simpo=SimPOLoss,
    ppo_value=PPOValueLoss,  # no upstream short name: upstream has no critic loss yet
)
# Upstream's losses this build does not provide, and why.
NOT_PROVIDED = {
    "GSPOLoss": "its sequence-level importance ratio is not the core's per-token ppo_loss",
    "SAPOLoss": "its soft gate is not the core's clipped surrogate",
    "CISPOLoss": "its detached clipped weight on logp is not the core's clipped surrogate",
    "GKDLoss": "distillation needs the teacher's logits, which the core's loss seam does not take",
    "CPOLoss": "its behaviour-cloning term is not in the core's dpo_loss",
    "ORPOLoss": "its odds-ratio loss is not in the core",
    "MSELoss": "not in the core",
    "InfonceLoss": "embedding training is not in the core",
    "ChunkedCrossEntropyLoss": "use CrossEntropyLoss: the core's cross entropy is already fused "
    "and chunked",
    "LigerFusedLinearCrossEntropyLoss": "use CrossEntropyLoss: the core fuses the lm_head and the "
    "cross entropy itself",
}


def make_loss(loss_cls: Any, **kwargs: Any) -> Loss:
    """The loss `loss_cls` names: a `Loss` instance (then no `kwargs`), a `Loss` subclass or a
    name in `LOSSES`, built with `kwargs`.

    Raises ``ValueError`` for anything else (naming why for upstream's losses this build does
    not provide, listing the known names otherwise), for `kwargs` with an instance, and for
    arguments the class refuses; ``TypeError`` for unknown arguments.
    """
    if isinstance(loss_cls, Loss):
        if kwargs:
            raise ValueError(f"set_loss({loss_cls!r}) takes no arguments with an instance")
        return loss_cls
    if isinstance(loss_cls, type) and issubclass(loss_cls, Loss):
        return loss_cls(**kwargs)
    name = loss_cls if isinstance(loss_cls, str) else getattr(loss_cls, "__name__", repr(loss_cls))
    if isinstance(loss_cls, str) and name in LOSSES:
        return LOSSES[name](**kwargs)
    if name in NOT_PROVIDED:
        raise ValueError(f"loss {name!r} is not available in this build: {NOT_PROVIDED[name]}")
    raise ValueError(
        f"unknown loss {loss_cls!r}; use a twinkle.loss class or one of {sorted(LOSSES)}"
    )


__all__ = [
    "LOSSES",
    "NOT_PROVIDED",
    "BNPOLoss",
    "CrossEntropyLoss",
    "DPOLoss",
    "DRGRPOLoss",
    "GRPOLoss",
    "Loss",
    "LossInputError",
    "PPOLoss",
    "PPOValueLoss",
    "SimPOLoss",
    "make_loss",
]
