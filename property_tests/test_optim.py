"""Property tests: AdamW against torch.optim.AdamW, schedules against megatron-core's
OptimizerParamScheduler, and clip_by_global_norm's bound, over random arguments."""

import warnings

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from twinkle_fn import schedules
from twinkle_fn.optim import adamw, apply_updates, clip_by_global_norm
from twinkle_fn.pytree import tree_global_norm, tree_leaves

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron-core's deprecation notices on import
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

SETTINGS = settings(max_examples=100, deadline=None)

shapes = st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple)


@SETTINGS
@given(
    shape_list=st.lists(shapes, min_size=1, max_size=4),
    lr=st.floats(1e-4, 1e-1),
    b1=st.floats(0.0, 0.99),
    b2=st.floats(0.5, 0.9999),
    eps=st.floats(1e-10, 1e-4),
    weight_decay=st.floats(0.0, 0.5),
    steps=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_adamw_matches_torch(shape_list, lr, b1, b2, eps, weight_decay, steps, seed):
    # float64: the only difference from torch is the rounding of the decoupled decay (~1e-16).
    gen = torch.Generator().manual_seed(seed)
    params = {
        f"p{i}": torch.randn(s, generator=gen, dtype=torch.float64)
        for i, s in enumerate(shape_list)
    }
    refs = [torch.nn.Parameter(p.clone()) for p in params.values()]
    opt = torch.optim.AdamW(refs, lr=lr, betas=(b1, b2), eps=eps, weight_decay=weight_decay)
    tx = adamw(lr, b1, b2, eps, weight_decay, mask=None)
    state = tx.init(params)
    for _ in range(steps):
        grads = {k: torch.randn(p.shape, generator=gen, dtype=p.dtype) for k, p in params.items()}
        for r, g in zip(refs, grads.values(), strict=True):
            r.grad = g.clone()
        opt.step()
        updates, state = tx.update(grads, state, params)
        apply_updates(params, updates)
    for ours, ref in zip(params.values(), refs, strict=True):
        torch.testing.assert_close(ours, ref.detach(), rtol=1e-10, atol=1e-12)


class _StandInOptimizer:
    def __init__(self):
        self.param_groups = [{}]


@st.composite
def megatron_args(draw):
    max_lr = draw(st.floats(1e-6, 1.0))
    decay = draw(st.integers(1, 40))
    style = draw(st.sampled_from(schedules.MEGATRON_STYLES))
    return {
        "lr_decay_style": style,
        "max_lr": max_lr,
        "min_lr": draw(st.floats(0.0, 1.0)) * max_lr,
        "init_lr": draw(st.floats(0.0, 1.0)) * max_lr,
        "lr_warmup_steps": draw(st.integers(0, decay - 1)),
        "lr_decay_steps": decay,
        "wsd_decay_steps": draw(st.integers(0, decay)) if style == "WSD" else None,
        "lr_wsd_decay_style": (
            draw(st.sampled_from(schedules.WSD_DECAY_STYLES)) if style == "WSD" else None
        ),
    }


@SETTINGS
@given(args=megatron_args())
def test_schedules_equal_megatron(args):
    opt = _StandInOptimizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "could not determine rank": single process
        ref = OptimizerParamScheduler(
            opt, start_wd=0.0, end_wd=0.0, wd_incr_steps=1, wd_incr_style="constant", **args
        )
    ours = schedules.megatron(**args)
    for step in range(args["lr_decay_steps"] + 4):
        expected = opt.param_groups[0]["lr"]
        # Same float64 formulas on the host: equal up to the last bit.
        assert abs(ours(step) - expected) <= 1e-12 * abs(expected), (step, ours(step), expected)
        ref.step(1)


@SETTINGS
@given(
    shape_list=st.lists(shapes, min_size=1, max_size=4),
    log_scale=st.floats(-4.0, 4.0),
    max_norm=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
)
def test_clipped_norm_is_at_most_max_norm(shape_list, log_scale, max_norm, seed):
    gen = torch.Generator().manual_seed(seed)
    grads = [(10.0**log_scale) * torch.randn(s, generator=gen) for s in shape_list]
    before = tree_global_norm(grads).item()
    originals = [g.clone() for g in grads]
    tx = clip_by_global_norm(max_norm)
    out, _ = tx.update(grads, tx.init(grads))
    after = tree_global_norm(out).item()
    # float32 norms: recomputing the norm of the scaled tree may round up by a few ulps.
    assert after <= max_norm * (1 + 1e-5)
    if before * (1 + 1e-5) + 2e-6 <= max_norm:  # scale = max_norm / (norm + 1e-6) >= 1: a no-op
        assert all(torch.equal(a, b) for a, b in zip(tree_leaves(out), originals, strict=True))
