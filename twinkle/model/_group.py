"""Upstream's optimizer group, one per model here: what the trained adapter (or ``''``, the
full model) trains with, how it is looked up by adapter name, and the settings checks of the
training calls (accumulation steps, loss, a new adapter).

The group's optimizer and scheduler become the core's transform through `optim`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from twinkle.data_format import ModelOutput
from twinkle.model import optim
from twinkle.processor import InputProcessor
from twinkle.template import Template
from twinkle_fn.optim import GradientTransformation, Schedule

LOSSES = ("CrossEntropyLoss", "cross_entropy")


@dataclasses.dataclass
class Group:
    """Upstream's optimizer group: what one adapter (or ``''``, the full model) trains with."""

    name: str = ""
    gradient_accumulation_steps: int = 1
    optimizer: optim.OptimizerSpec = dataclasses.field(
        default_factory=lambda: optim.optimizer_spec("AdamW")
    )
    scheduler: tuple[Any, dict[str, Any]] | None = None
    template: Template | None = None
    processor: InputProcessor | None = None
    last: tuple[dict[str, torch.Tensor], ModelOutput, bool] | None = None  # batch, out, train
    eval_sums: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.0])


def resolve(g: Group, adapter_name: str | None) -> Group:
    """`g` when `adapter_name` names it (None: the model's group).

    Raises ``ValueError`` for ``''`` once an adapter trains, and for any other name.
    """
    if adapter_name is None or adapter_name == g.name:
        return g
    if adapter_name == "" and g.name:
        raise ValueError(
            f"this model trains adapter {g.name!r}; the full-parameter group '' no longer "
            f"trains (one adapter per model in this build): pass adapter_name={g.name!r}"
        )
    have = repr(g.name) if g.name else "no adapter (only the default group '')"
    raise ValueError(
        f"adapter {adapter_name!r} does not exist; this model has {have}. Add it with "
        "add_adapter_to_model(name, LoraConfig(...)) before training"
    )


def learning_rate(g: Group) -> float | Schedule:
    """The group's lr: its optimizer's, scheduled when a scheduler is set."""
    if g.scheduler is None:
        return g.optimizer.lr
    cls, kwargs = g.scheduler
    return optim.schedule(cls, g.optimizer.lr, **kwargs)


def transform(g: Group, max_grad_norm: float | None) -> GradientTransformation:
    """The group's optimizer transform, clipping to `max_grad_norm` unless it is None."""
    return optim.transform(g.optimizer, learning_rate(g), max_grad_norm)


def set_scheduler(g: Group, scheduler_cls: Any, kwargs: dict[str, Any]) -> None:
    """Schedule the group's lr with `scheduler_cls(**kwargs)`. Raises ``ValueError`` (before
    changing anything) for what `optim.schedule` rejects."""
    optim.schedule(scheduler_cls, g.optimizer.lr, **kwargs)
    g.scheduler = (scheduler_cls, kwargs)


def accumulation_steps(g: Group, gradient_accumulation_steps: int | None) -> int:
    """`gradient_accumulation_steps`, else the group's. Raises ``ValueError`` unless it is a
    positive int."""
    gas = gradient_accumulation_steps or g.gradient_accumulation_steps
    if isinstance(gas, bool) or not isinstance(gas, int) or gas < 1:
        raise ValueError(f"gradient_accumulation_steps must be a positive int, got {gas!r}")
    return gas


def check_new_adapter(g: Group, adapter_name: Any, state_built: bool, is_trainable: bool) -> None:
    """Raises ``ValueError`` unless adapter `adapter_name` can be added to the model of `g`: a
    non-empty name, no adapter yet, no state built yet, and `is_trainable`."""
    if not isinstance(adapter_name, str) or not adapter_name:
        raise ValueError(f"adapter_name must be a non-empty str, got {adapter_name!r}")
    if g.name:
        raise ValueError(
            f"this model already has adapter {g.name!r}; this build trains one adapter per "
            "model (upstream's multi-adapter groups are not supported)"
        )
    if state_built:
        raise ValueError("add adapters before the first forward/step (the state is built then)")
    if not is_trainable:
        raise ValueError("is_trainable=False is not supported: an added adapter trains")


def check_loss(loss_cls: Any, kwargs: dict[str, Any]) -> None:
    """Raises ``ValueError`` unless `loss_cls` is the cross entropy with ignore_index -100."""
    name = loss_cls if isinstance(loss_cls, str) else getattr(loss_cls, "__name__", "")
    if name not in LOSSES:
        raise ValueError(
            f"loss {loss_cls!r} is not available; this build trains with the causal-LM "
            f"cross entropy only ({' / '.join(LOSSES)})"
        )
    if kwargs.get("ignore_index", -100) != -100:
        raise ValueError(f"ignore_index must be -100, got {kwargs['ignore_index']}")


def add_eval(g: Group, out: ModelOutput) -> None:
    """Count an evaluation forward's ``loss`` and ``num_tokens`` into the group's sums."""
    g.eval_sums[0] += out["loss"] * out["num_tokens"]
    g.eval_sums[1] += out["num_tokens"]


def pop_eval(g: Group) -> dict[str, float | int]:
    """The token-mean ``loss`` and ``num_tokens`` of the evaluation forwards since the last
    call; resets the sums."""
    loss_sum, num_tokens = g.eval_sums
    g.eval_sums = [0.0, 0.0]
    return {"loss": loss_sum / max(num_tokens, 1.0), "num_tokens": int(num_tokens)}


def last_loss(g: Group) -> float:
    """The loss of the group's last forward. Raises ``ValueError`` before any forward."""
    if g.last is None:
        raise ValueError("calculate_loss needs a forward/forward_only call first")
    return g.last[1]["loss"]


def describe(g: Group) -> list[str]:
    """Readable lines on how the group trains (adapter, optimizer, schedule, loss...)."""
    opt = g.optimizer
    sched = "constant lr" if g.scheduler is None else f"{g.scheduler[0]}({g.scheduler[1]})"
    processor = g.processor
    return [
        f"adapter: {g.name or 'none (full parameters)'}",
        f"optimizer: {opt.name}(lr={opt.lr}, {opt.kwargs})",
        f"lr_scheduler: {sched}",
        f"gradient_accumulation_steps: {g.gradient_accumulation_steps}",
        "loss: CrossEntropyLoss (token mean over every micro-batch and data rank)",
        f"processor: padding_free={processor.padding_free if processor else False}",
    ]
