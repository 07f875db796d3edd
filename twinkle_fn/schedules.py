"""Learning-rate schedules with the semantics of megatron-core's ``OptimizerParamScheduler``.

A schedule maps the number of updates already applied (0 for the first update) to a learning
rate, exactly as Megatron's ``get_lr`` does at ``num_steps``:

- warmup: for ``0 < step <= warmup_steps`` (and step 0), ``init_lr + (peak_lr - init_lr) *
  step / warmup_steps`` -- so the warmup ends *at* ``peak_lr`` on step ``warmup_steps``;
- ``constant`` then stays at ``peak_lr`` for ever;
- any other style returns ``min_lr`` for every ``step > decay_steps``;
- in between, ``min_lr + coeff * (peak_lr - min_lr)`` with ``coeff`` going from 1 to 0 over
  ``warmup_steps..decay_steps`` (linear, cosine), or held at 1 until the last
  ``wsd_decay_steps`` steps before ``decay_steps`` (warmup-stable-decay);
- ``inverse-square-root`` is ``max(min_lr, peak_lr * sqrt(max(warmup_steps, 1) / max(step, 1)))``.

The constant or peak lr (``lr``, ``peak_lr``, ``max_lr``) must be > 0: an lr of 0 trains nothing.
The warmup must be shorter than the schedule (``warmup_steps < decay_steps``): a longer one never
reaches its peak. Both are refused, naming the values and the fix; so are the optimizers' constant
lrs (`twinkle_fn.optim.base.check_lr`).

Megatron's per-param-group ``max_lr``/``min_lr`` overrides are just a second schedule built with
those values. Schedules are frozen dataclasses: picklable, comparable and printable.
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass
from typing import Any

from twinkle_fn.optim.base import Schedule, check_positive_lr

MEGATRON_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


@dataclass(frozen=True, slots=True)
class LRSchedule:
    """A warmup-then-decay schedule; build one with the functions of this module, which check
    the arguments. `style` is a Megatron ``lr_decay_style``; `decay_steps` is ``None`` only for
    styles that never fall to `min_lr` (constant, inverse-square-root without a cut-off)."""

    style: str
    peak_lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int | None
    init_lr: float = 0.0
    wsd_decay_steps: int | None = None
    wsd_decay_style: str | None = None

    def __call__(self, step: int) -> float:
        """The lr for the update that follows `step` applied updates (an int or a 0-d integer
        tensor). Raises ``ValueError`` for a negative step, ``TypeError`` for a non-integer."""
        n = operator.index(step)
        if n < 0:
            raise ValueError(f"step must be >= 0, got {n}")
        if self.warmup_steps > 0 and n <= self.warmup_steps:
            return self.init_lr + (self.peak_lr - self.init_lr) * float(n) / float(
                self.warmup_steps
            )
        if self.style == "constant":
            return self.peak_lr
        if self.decay_steps is not None and n > self.decay_steps:
            return self.min_lr
        if self.style == "inverse-square-root":
            lr = self.peak_lr * max(self.warmup_steps, 1) ** 0.5 / max(n, 1) ** 0.5
            return max(self.min_lr, lr)
        return self.min_lr + self._coeff(n) * (self.peak_lr - self.min_lr)

    def _coeff(self, n: int) -> float:
        """The decay factor in [0, 1] for ``warmup_steps < n <= decay_steps``."""
        assert self.decay_steps is not None  # constant and inverse-square-root returned earlier
        if self.style == "WSD":
            assert self.wsd_decay_steps is not None
            anneal_start = self.decay_steps - self.wsd_decay_steps
            if n <= anneal_start:
                return 1.0
            return _decay_coeff(
                self.wsd_decay_style, float(n - anneal_start) / self.wsd_decay_steps
            )
        ratio = float(n - self.warmup_steps) / float(self.decay_steps - self.warmup_steps)
        return _decay_coeff(self.style, ratio)


def _decay_coeff(style: str | None, ratio: float) -> float:
    """1 at ``ratio == 0`` falling to 0 at ``ratio == 1``, with the shape named by `style`."""
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return 2.0 * math.pow(0.5, ratio) - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(ratio)
    raise ValueError(f"unknown decay style {style!r}")


def constant(lr: float, warmup_steps: int = 0, init_lr: float = 0.0) -> Schedule:
    """`lr` for ever, after an optional linear warmup from `init_lr` over `warmup_steps`.

    Raises ``ValueError`` for a negative or non-numeric lr or step count, or ``init_lr > lr``.
    """
    lr, init_lr = _peak_lr("lr", lr), _lr("init_lr", init_lr)
    warmup_steps = _steps("warmup_steps", warmup_steps)
    _at_most("init_lr", init_lr, "lr", lr)
    return LRSchedule("constant", lr, 0.0, warmup_steps, None, init_lr)


def warmup_linear(
    peak_lr: float,
    warmup_steps: int,
    decay_steps: int,
    init_lr: float = 0.0,
    min_lr: float = 0.0,
) -> Schedule:
    """Linear warmup from `init_lr` to `peak_lr` over `warmup_steps`, then linear decay to `min_lr`
    at step `decay_steps` (counted from step 0, warmup included), then `min_lr`.

    Raises ``ValueError`` for a negative or non-numeric argument, ``warmup_steps >= decay_steps``,
    ``min_lr > peak_lr`` or ``init_lr > peak_lr``.
    """
    return _decaying("linear", peak_lr, warmup_steps, decay_steps, init_lr, min_lr)


def warmup_cosine(
    peak_lr: float,
    warmup_steps: int,
    decay_steps: int,
    init_lr: float = 0.0,
    min_lr: float = 0.0,
) -> Schedule:
    """Linear warmup from `init_lr` to `peak_lr` over `warmup_steps`, then half-cosine decay to
    `min_lr` at step `decay_steps`, then `min_lr`. Raises as `warmup_linear`."""
    return _decaying("cosine", peak_lr, warmup_steps, decay_steps, init_lr, min_lr)


def wsd(
    peak_lr: float,
    warmup_steps: int,
    decay_steps: int,
    wsd_decay_steps: int,
    decay_style: str = "linear",
    init_lr: float = 0.0,
    min_lr: float = 0.0,
) -> Schedule:
    """Warmup-stable-decay: linear warmup to `peak_lr`, flat at `peak_lr` until step
    ``decay_steps - wsd_decay_steps``, then a `decay_style` anneal ('linear', 'cosine',
    'exponential' or 'minus_sqrt') to `min_lr` at step `decay_steps`, then `min_lr`.

    Raises as `warmup_linear`, and ``ValueError`` if `wsd_decay_steps` is not in
    ``[0, decay_steps]`` or `decay_style` is unknown.
    """
    base = _decaying("WSD", peak_lr, warmup_steps, decay_steps, init_lr, min_lr)
    wsd_decay_steps = _steps("wsd_decay_steps", wsd_decay_steps)
    _at_most("wsd_decay_steps", wsd_decay_steps, "decay_steps", base.decay_steps)
    if decay_style not in WSD_DECAY_STYLES:
        raise ValueError(f"decay_style must be one of {WSD_DECAY_STYLES}, got {decay_style!r}")
    return LRSchedule(
        "WSD",
        base.peak_lr,
        base.min_lr,
        base.warmup_steps,
        base.decay_steps,
        base.init_lr,
        wsd_decay_steps,
        decay_style,
    )


def inverse_sqrt(
    peak_lr: float,
    warmup_steps: int,
    decay_steps: int | None = None,
    init_lr: float = 0.0,
    min_lr: float = 0.0,
) -> Schedule:
    """Linear warmup to `peak_lr`, then ``peak_lr * sqrt(max(warmup_steps, 1) / step)`` floored at
    `min_lr`; past `decay_steps` (if given) it is `min_lr`, as in Megatron. Raises as
    `warmup_linear` (the step checks only when `decay_steps` is given)."""
    if decay_steps is not None:
        return _decaying("inverse-square-root", peak_lr, warmup_steps, decay_steps, init_lr, min_lr)
    peak_lr, init_lr, min_lr = (
        _peak_lr("peak_lr", peak_lr),
        _lr("init_lr", init_lr),
        _lr("min_lr", min_lr),
    )
    warmup_steps = _steps("warmup_steps", warmup_steps)
    _at_most("min_lr", min_lr, "peak_lr", peak_lr)
    _at_most("init_lr", init_lr, "peak_lr", peak_lr)
    return LRSchedule("inverse-square-root", peak_lr, min_lr, warmup_steps, None, init_lr)


def megatron(
    lr_decay_style: str,
    max_lr: float,
    min_lr: float,
    lr_warmup_steps: int,
    lr_decay_steps: int,
    init_lr: float = 0.0,
    wsd_decay_steps: int | None = None,
    lr_wsd_decay_style: str | None = None,
) -> Schedule:
    """The schedule that megatron-core's ``OptimizerParamScheduler`` built with these arguments
    gives (its ``get_lr`` at ``num_steps == step``).

    `lr_decay_style` is one of Megatron's names: 'constant', 'linear', 'cosine',
    'inverse-square-root', 'WSD' (which needs `wsd_decay_steps` and `lr_wsd_decay_style`).
    Raises ``ValueError`` for an unknown style or for any argument Megatron rejects (negative
    values, ``lr_warmup_steps >= lr_decay_steps``, ``min_lr > max_lr``, ``init_lr > max_lr``).
    """
    if lr_decay_style not in MEGATRON_STYLES:
        raise ValueError(f"lr_decay_style must be one of {MEGATRON_STYLES}, got {lr_decay_style!r}")
    max_lr = _peak_lr("max_lr", max_lr)
    min_lr, init_lr = _lr("min_lr", min_lr), _lr("init_lr", init_lr)
    lr_warmup_steps = _steps("lr_warmup_steps", lr_warmup_steps)
    lr_decay_steps = _steps("lr_decay_steps", lr_decay_steps)
    _below("lr_warmup_steps", lr_warmup_steps, "lr_decay_steps", lr_decay_steps)
    _at_most("min_lr", min_lr, "max_lr", max_lr)
    _at_most("init_lr", init_lr, "max_lr", max_lr)
    if lr_decay_style == "WSD":
        if wsd_decay_steps is None or lr_wsd_decay_style is None:
            raise ValueError(
                "lr_decay_style='WSD' needs wsd_decay_steps and lr_wsd_decay_style "
                f"(one of {WSD_DECAY_STYLES})"
            )
        wsd_decay_steps = _steps("wsd_decay_steps", wsd_decay_steps)
        _at_most("wsd_decay_steps", wsd_decay_steps, "lr_decay_steps", lr_decay_steps)
        if lr_wsd_decay_style not in WSD_DECAY_STYLES:
            raise ValueError(
                f"lr_wsd_decay_style must be one of {WSD_DECAY_STYLES}, got {lr_wsd_decay_style!r}"
            )
        return LRSchedule(
            "WSD",
            max_lr,
            min_lr,
            lr_warmup_steps,
            lr_decay_steps,
            init_lr,
            wsd_decay_steps,
            lr_wsd_decay_style,
        )
    decay_steps = None if lr_decay_style == "constant" else lr_decay_steps
    return LRSchedule(lr_decay_style, max_lr, min_lr, lr_warmup_steps, decay_steps, init_lr)


def _decaying(
    style: str, peak_lr: Any, warmup_steps: Any, decay_steps: Any, init_lr: Any, min_lr: Any
) -> LRSchedule:
    """A checked schedule of a style that falls to `min_lr` at `decay_steps`."""
    peak_lr, init_lr, min_lr = (
        _peak_lr("peak_lr", peak_lr),
        _lr("init_lr", init_lr),
        _lr("min_lr", min_lr),
    )
    warmup_steps = _steps("warmup_steps", warmup_steps)
    decay_steps = _steps("decay_steps", decay_steps)
    _below("warmup_steps", warmup_steps, "decay_steps", decay_steps)
    _at_most("min_lr", min_lr, "peak_lr", peak_lr)
    _at_most("init_lr", init_lr, "peak_lr", peak_lr)
    return LRSchedule(style, peak_lr, min_lr, warmup_steps, decay_steps, init_lr)


def _lr(name: str, value: Any) -> float:
    """`value` as a float, checked to be a finite real number >= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value) or value < 0.0:
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    return value


def _peak_lr(name: str, value: Any) -> float:
    """`value` as a float, checked as `_lr` and to be > 0 (`check_positive_lr`): the schedule's
    constant or peak lr."""
    return check_positive_lr(name, _lr(name, value))


def _steps(name: str, value: Any) -> int:
    """`value` as an int, checked to be an integer >= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def _at_most(name: str, value: float, bound_name: str, bound: float | None) -> None:
    if bound is not None and value > bound:
        raise ValueError(f"{name} ({value}) must be <= {bound_name} ({bound})")


def _below(name: str, value: int, bound_name: str, bound: int) -> None:
    """Raises ``ValueError`` unless warmup length `value` < schedule length `bound`."""
    if value >= bound:
        raise ValueError(
            f"{name} ({value}) must be < {bound_name} ({bound}): the warmup would outlast the "
            f"schedule; lower {name} or raise {bound_name}"
        )
