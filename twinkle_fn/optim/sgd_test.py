import math

import pytest
import torch

from twinkle_fn.optim import SGDState, apply_updates, default_decay_mask, sgd
from twinkle_fn.pytree import tree_leaves

# torch applies `p.add_(g, alpha=-lr)` in one fused kernel; we round `-lr*g` first, then add:
# ~1 ulp per step, so float32 stays within 1e-6 over a few steps and float64 within 1e-12.
TOL = {torch.float32: 1e-6, torch.float64: 1e-12}
STEPS = 5


def _init_params(dtype):
    gen = torch.Generator().manual_seed(0)
    return {
        "proj.weight": torch.randn(5, 3, generator=gen, dtype=dtype),
        "proj.bias": torch.randn(5, generator=gen, dtype=dtype),
        "ln.weight": torch.randn(3, generator=gen, dtype=dtype),
    }


def _run_both(tx, torch_groups, params, torch_kwargs, lr_per_step=None):
    refs = {k: torch.nn.Parameter(p.clone()) for k, p in params.items()}
    opt = torch.optim.SGD(
        [{**g, "params": [refs[k] for k in g["params"]]} for g in torch_groups], **torch_kwargs
    )
    ours = {k: p.clone() for k, p in params.items()}
    state = tx.init(ours)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        grads = {k: torch.randn(p.shape, generator=gen, dtype=p.dtype) for k, p in params.items()}
        for k in params:
            refs[k].grad = grads[k].clone()
        if lr_per_step:
            for g in opt.param_groups:
                g["lr"] = lr_per_step(step)
        opt.step()
        updates, state = tx.update(grads, state, ours)
        apply_updates(ours, updates)
    return ours, {k: r.detach() for k, r in refs.items()}, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("momentum", "nesterov", "weight_decay"),
    [(0.0, False, 0.0), (0.0, False, 0.1), (0.9, False, 0.0), (0.9, False, 0.1), (0.9, True, 0.1)],
)
def test_matches_torch_sgd(dtype, momentum, nesterov, weight_decay):
    params = _init_params(dtype)
    kwargs = {"lr": 0.1, "momentum": momentum, "nesterov": nesterov}
    tx = sgd(weight_decay=weight_decay, mask=None, **kwargs)
    groups = [{"params": list(params), "weight_decay": weight_decay}]
    ours, ref, state = _run_both(tx, groups, params, kwargs)
    for k in params:
        torch.testing.assert_close(ours[k], ref[k], rtol=TOL[dtype], atol=TOL[dtype])
    assert int(state.count) == STEPS


def test_default_mask_matches_torch_with_two_param_groups():
    params = _init_params(torch.float64)
    groups = [
        {"params": ["proj.weight"], "weight_decay": 0.2},
        {"params": ["proj.bias", "ln.weight"], "weight_decay": 0.0},
    ]
    assert [k for k, p in params.items() if default_decay_mask(k, p)] == ["proj.weight"]
    kwargs = {"lr": 0.05, "momentum": 0.8, "nesterov": True}
    ours, ref, _ = _run_both(sgd(weight_decay=0.2, **kwargs), groups, params, kwargs)
    for k in params:
        torch.testing.assert_close(ours[k], ref[k], rtol=1e-12, atol=1e-12)


def test_schedule_matches_torch_with_per_step_lr():
    params = _init_params(torch.float64)

    def schedule(count: int) -> float:
        return 0.1 / (1 + count)

    kwargs = {"lr": schedule(0), "momentum": 0.5}
    tx = sgd(schedule, momentum=0.5)
    groups = [{"params": list(params)}]
    ours, ref, state = _run_both(tx, groups, params, kwargs, lr_per_step=schedule)
    for k in params:
        torch.testing.assert_close(ours[k], ref[k], rtol=1e-12, atol=1e-12)
    assert math.isclose(float(state.lr), schedule(STEPS - 1))


def test_state_and_in_place_update():
    params = {"w": torch.ones(2, 2)}
    plain = sgd(0.5).init(params)
    assert isinstance(plain, SGDState) and plain.momentum is None
    assert len(tree_leaves(plain)) == 2  # count and lr only
    tx = sgd(0.5, momentum=0.9)
    state = tx.init(params)
    grads = {"w": torch.full((2, 2), 2.0)}
    g = grads["w"]
    updates, state = tx.update(grads, state, params)
    assert updates["w"] is g and torch.equal(g, torch.full((2, 2), -1.0))
    assert torch.equal(state.momentum["w"], torch.full((2, 2), 2.0))  # torch's first buffer = g


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": "0.1"}, "lr must be a real number"),
        ({"lr": 0.1, "momentum": -0.5}, "momentum must be finite and >= 0"),
        ({"lr": 0.1, "weight_decay": math.inf}, "weight_decay must be finite"),
        ({"lr": 0.1, "nesterov": True}, "nesterov=True needs momentum > 0"),
    ],
)
def test_bad_hyperparameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sgd(**kwargs)


def test_weight_decay_needs_params():
    tx = sgd(0.1, weight_decay=0.1)
    with pytest.raises(ValueError, match="sgd: weight_decay > 0 needs the params"):
        tx.update({"w": torch.ones(2, 2)}, tx.init({"w": torch.ones(2, 2)}), None)
