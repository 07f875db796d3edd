"""The optimizer of a `twinkle train` / `twinkle rl` run: AdamW under a warmup-cosine schedule,
the core's transforms or megatron's distributed optimizer by backend, its settings checked."""

from __future__ import annotations

import math

import twinkle_fn as tf
from twinkle.cli import config as cfg

DEFAULT_WARMUP_STEPS = 20


def _optimizer(config: cfg.RunConfig) -> tf.optim.GradientTransformation:
    """AdamW with a warmup-cosine schedule from the lr down to ``min_lr_ratio`` of it, after
    clipping to the global norm ``optimizer.clip_grad``: the core's transforms on the
    transformers backend, megatron's distributed optimizer (the same update) on megatron.

    Raises ``ValueError`` (before anything is built) for an lr that is not a positive finite
    number, a negative or non-finite weight decay, and an explicit warmup that is not shorter
    than the run (it would never reach the lr): the same policy as the library's schedules and
    optimizers, which refuse them too.
    """
    opt = config.optimizer
    if not math.isfinite(opt.weight_decay) or opt.weight_decay < 0:
        raise ValueError(
            f"--weight-decay must be a finite number >= 0, got {opt.weight_decay}; pass e.g. "
            "--weight-decay 0.01 (optimizer.weight_decay in a config)"
        )
    schedule = tf.schedules.warmup_cosine(
        peak_lr=_check_lr(opt.lr),
        warmup_steps=_warmup_steps(config.schedule),
        decay_steps=config.schedule.steps,
        min_lr=opt.lr * config.schedule.min_lr_ratio,
    )
    return OPTIMIZERS[config.backend](schedule, opt.weight_decay, opt.clip_grad)


def _adamw(
    lr: tf.schedules.Schedule, weight_decay: float, clip_grad: float
) -> tf.optim.GradientTransformation:
    """The core's clipping then AdamW (what the transformers backend trains with)."""
    return tf.optim.chain(
        tf.optim.clip_by_global_norm(clip_grad), tf.optim.adamw(lr, weight_decay=weight_decay)
    )


def _megatron_adamw(
    lr: tf.schedules.Schedule, weight_decay: float, clip_grad: float
) -> tf.optim.GradientTransformation:
    """megatron-core's distributed optimizer: the same update, and the only one the megatron
    backend checkpoints and shards over tp / pp."""
    return tf.optim.megatron_optimizer(lr, weight_decay=weight_decay, clip_grad=clip_grad)


# The optimizer each backend trains with.
OPTIMIZERS = {"transformers": _adamw, "megatron": _megatron_adamw}


def _check_lr(lr: float) -> float:
    """`lr`; raises ``ValueError`` unless it is a positive finite number."""
    if not math.isfinite(lr) or lr <= 0:
        raise ValueError(
            f"--lr must be a positive finite number, got {lr}: a learning rate of 0 trains "
            "nothing; pass e.g. --lr 3e-3 (optimizer.lr in a config)"
        )
    return lr


def _warmup_steps(schedule: cfg.ScheduleConfig) -> int:
    """``warmup_steps``, or by default 20 capped to ``steps - 1``. Raises ``ValueError`` for
    an explicit warmup that is not shorter than the run."""
    steps = schedule.steps
    if schedule.warmup_steps is None:
        return min(DEFAULT_WARMUP_STEPS, steps - 1)
    if schedule.warmup_steps >= steps:
        raise ValueError(
            f"--warmup-steps {schedule.warmup_steps} must be < --steps {steps}: the warmup "
            f"would outlast the run and never reach --lr; lower --warmup-steps (e.g. "
            f"{steps // 10}) or raise --steps"
        )
    return schedule.warmup_steps
