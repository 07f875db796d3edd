"""megatron-core's distributed optimizer as a `tf.optim` transform (built by the megatron backend,
whose modules load on first use)."""

from __future__ import annotations

from twinkle_fn import backends
from twinkle_fn.optim.base import GradientTransformation, Schedule


def megatron_optimizer(
    lr: float | Schedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    clip_grad: float = 1.0,
    loss_scale: float | None = None,
    initial_loss_scale: float = 2.0**32,
) -> GradientTransformation:
    """AdamW through megatron-core's ``DistributedOptimizer``, for models on the megatron backend.

    fp32 main parameters, Adam moments sharded over data-parallel ranks, gradients clipped to the
    global norm `clip_grad` across tp / pp / ep (0 disables), decoupled weight decay on matrices
    only; `lr` is a float or a `twinkle_fn.schedules` schedule of the number of updates applied,
    as megatron's ``OptimizerParamScheduler`` sets it. fp16 only: `loss_scale` is a constant
    loss scale, or None for megatron's dynamic scaler from `initial_loss_scale`. See
    `twinkle_fn.backends.megatron.optimizer.megatron_optimizer`. Raises ``ValueError`` for an
    out-of-range hyper-parameter; its ``init`` raises ``TypeError`` for parameters of a model
    the megatron backend did not place.
    """
    return backends.get("megatron").optimizer(
        lr,
        b1=b1,
        b2=b2,
        eps=eps,
        weight_decay=weight_decay,
        clip_grad=clip_grad,
        loss_scale=loss_scale,
        initial_loss_scale=initial_loss_scale,
    )
