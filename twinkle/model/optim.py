"""Upstream optimizer and lr-scheduler names -> `twinkle_fn.optim` transforms and schedules.

Upstream passes a ``torch.optim`` class (or its name) and a ``torch.optim.lr_scheduler`` class
(or one of Twinkle's). Here each known name maps onto the functional core: an optax-style
transform whose learning rate is a schedule of the number of updates applied, which is exactly
when a torch scheduler stepped once per optimizer step would change it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import twinkle_fn as tf
from twinkle_fn.optim import GradientTransformation, Schedule
from twinkle_fn.optim.muon import EPS, NS_COEFFICIENTS, NS_STEPS

DEFAULT_LR = 1e-5
DEFAULT_WEIGHT_DECAY = 0.01


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """A chosen optimizer: its name, base learning rate and the transform's other arguments."""

    name: str
    lr: float
    kwargs: dict[str, Any]

    def transform(self, lr: float | Schedule) -> GradientTransformation:
        """The transform with learning rate `lr` (a float or a schedule)."""
        make = {"AdamW": tf.optim.adamw, "Adam": tf.optim.adamw, "Muon": tf.optim.muon}
        return make.get(self.name, tf.optim.sgd)(lr, **self.kwargs)


# torch's implementation switches: they pick a kernel, not the update, so they are accepted and
# ignored (the core has its own kernels).
_KERNEL_SWITCHES = ("foreach", "fused", "capturable")


def _adamw(
    lr: float = DEFAULT_LR,
    weight_decay: float = DEFAULT_WEIGHT_DECAY,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    amsgrad: bool = False,
) -> OptimizerSpec:
    if amsgrad:
        raise ValueError("AdamW(amsgrad=True) is not supported; use amsgrad=False")
    b1, b2 = betas
    return OptimizerSpec("AdamW", lr, dict(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))


def _adam(
    lr: float = DEFAULT_LR,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
) -> OptimizerSpec:
    # torch's Adam adds weight_decay * p to the gradient (L2, scaled by Adam's normaliser), an
    # update AdamW's decoupled decay does not reproduce; without decay the two are the same.
    if weight_decay:
        raise ValueError(
            f"Adam(weight_decay={weight_decay}) is coupled L2 regularisation, which this build "
            "does not have; use weight_decay=0, or 'AdamW' for decoupled weight decay"
        )
    if amsgrad:
        raise ValueError("Adam(amsgrad=True) is not supported; use amsgrad=False")
    b1, b2 = betas
    return OptimizerSpec("Adam", lr, dict(b1=b1, b2=b2, eps=eps, weight_decay=0.0))


def _sgd(
    lr: float = DEFAULT_LR,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = DEFAULT_WEIGHT_DECAY,
    nesterov: bool = False,
) -> OptimizerSpec:
    if dampening:
        raise ValueError(f"SGD(dampening={dampening}) is not supported; use dampening=0")
    return OptimizerSpec(
        "SGD", lr, dict(momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
    )


def _muon(
    lr: float = DEFAULT_LR,
    weight_decay: float = DEFAULT_WEIGHT_DECAY,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = EPS,
    ns_steps: int = NS_STEPS,
    adjust_lr_fn: str | None = None,
) -> OptimizerSpec:
    # torch.optim.Muon's own default decay (0.1) is what upstream's parameter groups override
    # with their weight_decay (default 0.01 on matrices), as for AdamW.
    kwargs = dict(
        weight_decay=weight_decay,
        momentum=momentum,
        nesterov=nesterov,
        ns_coefficients=tuple(ns_coefficients),
        eps=eps,
        ns_steps=ns_steps,
        adjust_lr_fn=adjust_lr_fn,
    )
    return OptimizerSpec("Muon", lr, kwargs)


# Decay applies to matrices only (biases and norms excluded), as upstream's parameter groups.
OPTIMIZERS: dict[str, Callable[..., OptimizerSpec]] = {
    "AdamW": _adamw,
    "default": _adamw,
    "Adam": _adam,
    "SGD": _sgd,
    "Muon": _muon,
}


def optimizer_spec(optimizer_cls: Any, **kwargs: Any) -> OptimizerSpec:
    """The optimizer named by `optimizer_cls` (a name, or ``torch.optim.AdamW``/``Adam``/
    ``SGD``/``Muon``) with torch's keyword arguments (``lr``, ``weight_decay``, ``betas``,
    ``eps``, ``momentum``, Muon's ``adjust_lr_fn``, ``ns_steps``...). ``Adam`` is taken without weight decay only (then it is AdamW with
    ``weight_decay=0``). torch's kernel switches ``foreach``, ``fused`` and ``capturable``
    are accepted and ignored: they choose how torch computes the update, not the update.

    Raises ``ValueError`` for an unknown optimizer (listing the known ones) or an unsupported
    setting, ``TypeError`` for an argument the optimizer does not take.
    """
    name = _name(optimizer_cls)
    if name not in OPTIMIZERS:
        raise ValueError(
            f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZERS)} "
            "(torch.optim.AdamW, Adam, SGD and Muon by class too)"
        )
    if "params" in kwargs:
        raise ValueError(
            "set_optimizer(params=...) is not supported: the trainable parameters are the "
            "model's (or its adapter's), with weight decay on matrices only"
        )
    kwargs = {k: v for k, v in kwargs.items() if k not in _KERNEL_SWITCHES}
    spec = OPTIMIZERS[name](**kwargs)
    spec.transform(spec.lr)  # check the hyper-parameters now, not at the first step
    return spec


def _cosine_warmup(
    lr: float, num_warmup_steps: int, num_training_steps: int, num_cycles: float = 0.5
) -> Schedule:
    if num_cycles != 0.5:
        raise ValueError(f"CosineWarmupScheduler(num_cycles={num_cycles}) supports 0.5 only")
    _check_warmup(num_warmup_steps, num_training_steps)
    return tf.schedules.warmup_cosine(lr, num_warmup_steps, num_training_steps)


def _linear_warmup(lr: float, num_warmup_steps: int, num_training_steps: int) -> Schedule:
    _check_warmup(num_warmup_steps, num_training_steps)
    return tf.schedules.warmup_linear(lr, num_warmup_steps, num_training_steps)


def _check_warmup(num_warmup_steps: Any, num_training_steps: Any) -> None:
    """Raises ``ValueError`` when the warmup is not shorter than the run (in upstream's names;
    the core checks the types and signs)."""
    ints = all(
        isinstance(n, int) and not isinstance(n, bool)
        for n in (num_warmup_steps, num_training_steps)
    )
    if ints and num_warmup_steps >= num_training_steps:
        raise ValueError(
            f"num_warmup_steps ({num_warmup_steps}) must be < num_training_steps "
            f"({num_training_steps}): the warmup would outlast the run and never reach the "
            "optimizer's lr; lower num_warmup_steps or raise num_training_steps"
        )


def _param_scheduler(
    lr: float,
    lr_decay_steps: int,
    max_lr: float | None = None,
    lr_warmup_steps: int = 0,
    lr_decay_style: str = "cosine",
    min_lr: float = 0.0,
    init_lr: float = 0.0,
    wsd_decay_steps: int | None = None,
    lr_wsd_decay_style: str | None = None,
) -> Schedule:
    return tf.schedules.megatron(
        lr_decay_style,
        lr if max_lr is None else max_lr,
        min_lr,
        lr_warmup_steps,
        lr_decay_steps,
        init_lr,
        wsd_decay_steps,
        lr_wsd_decay_style,
    )


def _cosine_annealing(lr: float, T_max: int, eta_min: float = 0.0) -> Schedule:
    return tf.schedules.megatron("cosine", lr, eta_min, 0, T_max)


def _linear_lr(
    lr: float, start_factor: float = 1.0 / 3, end_factor: float = 1.0, total_iters: int = 5
) -> Schedule:
    if end_factor != 1.0:
        raise ValueError(f"LinearLR(end_factor={end_factor}) supports end_factor=1.0 only")
    return tf.schedules.constant(lr, warmup_steps=total_iters, init_lr=start_factor * lr)


# Within the training horizon each equals its torch/Twinkle namesake; past it, the core's
# schedules stay at the minimum where torch's cosine climbs back.
SCHEDULERS: dict[str, Callable[..., Schedule]] = {
    "CosineWarmupScheduler": _cosine_warmup,
    "LinearWarmupScheduler": _linear_warmup,
    "default": _param_scheduler,
    "OptimizerParamScheduler": _param_scheduler,
    "CosineAnnealingLR": _cosine_annealing,
    "LinearLR": _linear_lr,
}


def schedule(scheduler_cls: Any, lr: float, **kwargs: Any) -> Schedule:
    """The learning-rate schedule named by `scheduler_cls`, peaking at the optimizer's `lr`.

    Raises ``ValueError`` for an unknown scheduler (listing the known ones) or arguments the
    schedule rejects (among them a warmup as long as the run or longer: ``num_warmup_steps >=
    num_training_steps``, ``lr_warmup_steps >= lr_decay_steps``), ``TypeError`` for an argument
    it does not take. A rejection starts with the call as written (``CosineAnnealingLR(T_max=0):
    ...``), since the core's message may name its own field for one of upstream's.
    """
    name = _name(scheduler_cls)
    if name not in SCHEDULERS:
        raise ValueError(f"unknown lr scheduler {name!r}; known: {', '.join(SCHEDULERS)}")
    try:
        return SCHEDULERS[name](lr, **kwargs)
    except ValueError as e:
        call = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise ValueError(f"{name}({call}): {e}") from e


def transform(
    optimizer: OptimizerSpec, lr: float | Schedule, max_grad_norm: float | None
) -> GradientTransformation:
    """Clip by global norm (unless `max_grad_norm` is None or inf), then the optimizer.

    Both variants have the same (leafless) clip state, so a state built with one steps with the
    other: clipping is chosen per step, as upstream's ``clip_grad_norm`` call. Raises
    ``ValueError`` for a `max_grad_norm` that is not a positive finite number (or inf).
    """
    if max_grad_norm is None or max_grad_norm == math.inf:
        clip = tf.optim.chain()
    else:
        clip = tf.optim.clip_by_global_norm(max_grad_norm)
    return tf.optim.chain(clip, optimizer.transform(lr))


def _name(cls_or_name: Any) -> str:
    return cls_or_name if isinstance(cls_or_name, str) else getattr(cls_or_name, "__name__", "")
