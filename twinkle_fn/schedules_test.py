import math
import pickle
import warnings

import pytest
import torch

from twinkle_fn import schedules

# Both sides evaluate the same float64 formulas on the host; allow only last-bit differences.
REL = 1e-12


class _StandInOptimizer:
    """What OptimizerParamScheduler touches on an optimizer: a list of param-group dicts."""

    def __init__(self, group: dict):
        self.param_groups = [dict(group)]


@pytest.fixture(scope="module")
def megatron_lrs():
    """``megatron_lrs(n, group={}, **scheduler_kwargs)``: the lr Megatron's scheduler sets on the
    param group for the updates after 0..n applied steps."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core's own deprecation notices on import
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    def run(n: int, group: dict | None = None, **kwargs) -> list[float]:
        opt = _StandInOptimizer(group or {})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "could not determine rank": single process
            sched = OptimizerParamScheduler(
                opt, start_wd=0.0, end_wd=0.0, wd_incr_steps=1, wd_incr_style="constant", **kwargs
            )
        lrs = []
        for _ in range(n + 1):
            lrs.append(opt.param_groups[0]["lr"])
            sched.step(1)
        return lrs

    return run


def _megatron_kwargs(style, max_lr, min_lr, warmup, decay, init_lr=0.0, wsd=None, wsd_style=None):
    return {
        "lr_decay_style": style,
        "max_lr": max_lr,
        "min_lr": min_lr,
        "lr_warmup_steps": warmup,
        "lr_decay_steps": decay,
        "init_lr": init_lr,
        "wsd_decay_steps": wsd,
        "lr_wsd_decay_style": wsd_style,
    }


CASES = [
    (schedules.constant(1e-3), ("constant", 1e-3, 0.0, 0, 10)),
    (schedules.constant(1e-3, 4, init_lr=1e-5), ("constant", 1e-3, 1e-4, 4, 10, 1e-5)),
    (schedules.warmup_linear(1e-3, 3, 12, min_lr=1e-5), ("linear", 1e-3, 1e-5, 3, 12)),
    (schedules.warmup_linear(2e-4, 0, 9), ("linear", 2e-4, 0.0, 0, 9)),
    (schedules.warmup_cosine(3e-4, 5, 20, 1e-6, 1e-5), ("cosine", 3e-4, 1e-5, 5, 20, 1e-6)),
    (schedules.warmup_cosine(1e-3, 1, 2), ("cosine", 1e-3, 0.0, 1, 2)),
    (schedules.inverse_sqrt(1e-3, 4, 30, min_lr=1e-4), ("inverse-square-root", 1e-3, 1e-4, 4, 30)),
    (schedules.inverse_sqrt(1e-3, 0, 10), ("inverse-square-root", 1e-3, 0.0, 0, 10)),
    *[
        (
            schedules.wsd(1e-3, 2, 20, 6, style, min_lr=1e-5),
            ("WSD", 1e-3, 1e-5, 2, 20, 0.0, 6, style),
        )
        for style in schedules.WSD_DECAY_STYLES
    ],
    (schedules.wsd(1e-3, 3, 10, 10, "cosine"), ("WSD", 1e-3, 0.0, 3, 10, 0.0, 10, "cosine")),
    (schedules.wsd(1e-3, 3, 10, 0), ("WSD", 1e-3, 0.0, 3, 10, 0.0, 0, "linear")),
]


@pytest.mark.parametrize(
    ("ours", "args"), CASES, ids=[f"{a[0]}-{i}" for i, (_, a) in enumerate(CASES)]
)
def test_builders_and_dispatcher_equal_megatron_at_every_step(megatron_lrs, ours, args):
    kwargs = _megatron_kwargs(*args)
    n = kwargs["lr_decay_steps"] + 5  # past the end, where Megatron holds min_lr
    expected = megatron_lrs(n, **kwargs)
    dispatched = schedules.megatron(**kwargs)
    for step, lr in enumerate(expected):
        assert ours(step) == pytest.approx(lr, rel=REL, abs=0.0), step
        assert dispatched(step) == pytest.approx(lr, rel=REL, abs=0.0), step


def test_param_group_max_lr_and_min_lr_overrides_are_a_second_schedule(megatron_lrs):
    # Megatron reads max_lr/min_lr from the param group when present (but init_lr from itself).
    kwargs = _megatron_kwargs("cosine", 1e-3, 1e-5, 4, 16, init_lr=1e-6)
    expected = megatron_lrs(20, group={"max_lr": 5e-4, "min_lr": 5e-5}, **kwargs)
    ours = schedules.warmup_cosine(5e-4, 4, 16, init_lr=1e-6, min_lr=5e-5)
    assert [ours(n) for n in range(21)] == pytest.approx(expected, rel=REL, abs=0.0)


def test_shapes_at_the_boundaries():
    s = schedules.warmup_linear(1.0, 4, 8, init_lr=0.2, min_lr=0.1)
    assert s(0) == 0.2 and s(4) == 1.0 and s(8) == pytest.approx(0.1) and s(9) == 0.1
    assert s(6) == pytest.approx(0.55)
    unbounded = schedules.inverse_sqrt(1.0, 4)
    assert unbounded(16) == pytest.approx(0.5) and unbounded(10**6) == pytest.approx(2e-3)
    w = schedules.wsd(1.0, 0, 10, 4, "linear")
    assert [w(n) for n in (5, 6, 8, 10)] == pytest.approx([1.0, 1.0, 0.5, 0.0])


def test_unbounded_inverse_sqrt_equals_megatron_with_a_far_decay_end(megatron_lrs):
    expected = megatron_lrs(60, **_megatron_kwargs("inverse-square-root", 1e-3, 1e-6, 5, 10**9))
    ours = schedules.inverse_sqrt(1e-3, 5, min_lr=1e-6)
    assert [ours(n) for n in range(61)] == pytest.approx(expected, rel=REL, abs=0.0)


def test_schedule_accepts_a_count_tensor_and_pickles():
    s = schedules.warmup_cosine(1e-3, 2, 10)
    assert s(torch.tensor(5)) == s(5)
    assert pickle.loads(pickle.dumps(s)) == s
    with pytest.raises(ValueError, match="step must be >= 0"):
        s(-1)
    with pytest.raises(TypeError):
        s(1.5)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: schedules.constant("1e-3"), "lr must be a number"),
        (lambda: schedules.constant(1e-3, warmup_steps=-1), "warmup_steps must be >= 0"),
        (lambda: schedules.constant(1e-3, init_lr=1e-2), r"init_lr \(0.01\) must be <= lr"),
        (
            lambda: schedules.warmup_linear(1e-3, 10, 5),
            r"warmup_steps \(10\) must be < decay_steps",
        ),
        (lambda: schedules.warmup_linear(1e-3, 5, 5), r"warmup_steps \(5\) must be < decay_steps"),
        (
            lambda: schedules.warmup_cosine(1e-3, 50, 10),
            r"warmup_steps \(50\) must be < decay_steps \(10\): the warmup would outlast the "
            "schedule; lower warmup_steps or raise decay_steps",
        ),
        (lambda: schedules.constant(0.0), r"^lr must be > 0, got 0.0: a learning rate of 0"),
        (lambda: schedules.warmup_cosine(0, 0, 10), r"^peak_lr must be > 0, got 0.0"),
        (lambda: schedules.megatron("linear", 0.0, 0.0, 0, 10), r"^max_lr must be > 0"),
        (lambda: schedules.warmup_linear(1e-3, 0, -3), "decay_steps must be >= 0"),
        (lambda: schedules.warmup_cosine(1e-3, 1.5, 10), "warmup_steps must be an integer"),
        (lambda: schedules.warmup_cosine(1e-3, 0, 10, min_lr=1e-2), "min_lr .* must be <= peak_lr"),
        (lambda: schedules.warmup_cosine(math.nan, 0, 10), "peak_lr must be finite"),
        (lambda: schedules.warmup_cosine(True, 0, 10), "peak_lr must be a number"),
        (lambda: schedules.wsd(1e-3, 0, 10, 11), r"wsd_decay_steps \(11\) must be <= decay_steps"),
        (lambda: schedules.wsd(1e-3, 0, 10, 5, "step"), "decay_style must be one of"),
        (lambda: schedules.inverse_sqrt(1e-3, -2), "warmup_steps must be >= 0"),
        (lambda: schedules.megatron("cos", 1e-3, 0.0, 0, 10), "lr_decay_style must be one of"),
        (lambda: schedules.megatron("linear", "1e-3", 0.0, 0, 10), "max_lr must be a number"),
        (lambda: schedules.megatron("linear", 1e-3, 0.0, 10, 10), "lr_warmup_steps .* must be <"),
        (lambda: schedules.megatron("constant", 1e-3, 0.0, 0, 0), "lr_warmup_steps .* must be <"),
        (lambda: schedules.megatron("WSD", 1e-3, 0.0, 0, 10), "needs wsd_decay_steps"),
        (lambda: schedules.megatron("WSD", 1e-3, 0.0, 0, 10, 0.0, 4, "x"), "lr_wsd_decay_style"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(build, match):
    with pytest.raises(ValueError, match=match):
        build()
