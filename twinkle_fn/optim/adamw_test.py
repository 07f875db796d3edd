import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from twinkle_fn.optim import AdamWState, adamw, apply_updates, default_decay_mask
from twinkle_fn.pytree import tree_leaves
from twinkle_fn.testing_dist import spawn

# float32: the decay is applied as part of the additive update, not as torch's separate multiply,
# which costs a few ulps (~1e-7 relative) over several steps; float64 leaves only ~1e-16 per step.
TOL = {torch.float32: 1e-6, torch.float64: 1e-12}
STEPS = 6


def _init_params(dtype):
    gen = torch.Generator().manual_seed(0)
    return {
        "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=gen, dtype=dtype),
        "model.layers.0.mlp.up_proj.bias": torch.randn(6, generator=gen, dtype=dtype),
        "model.norm.weight": 1.0 + 0.1 * torch.randn(4, generator=gen, dtype=dtype),
        "lm_head.weight": torch.randn(5, 4, generator=gen, dtype=dtype),
    }


def _grads(params, gen):
    return {k: torch.randn(p.shape, generator=gen, dtype=p.dtype) for k, p in params.items()}


def _run_both(tx, torch_groups, params, lr_per_step=None):
    """Run `tx` and a torch optimizer over the same gradients; return both final params."""
    names = list(params)
    refs = {k: torch.nn.Parameter(p.clone()) for k, p in params.items()}
    opt = torch.optim.AdamW(
        [{**g, "params": [refs[k] for k in g["params"]]} for g in torch_groups],
        lr=lr_per_step(0) if lr_per_step else 1e-2,
        betas=(0.8, 0.95),
        eps=1e-6,
    )
    ours = {k: p.clone() for k, p in params.items()}
    state = tx.init(ours)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        grads = _grads(params, gen)
        for k in names:
            refs[k].grad = grads[k].clone()
        if lr_per_step:
            for g in opt.param_groups:
                g["lr"] = lr_per_step(step)
        opt.step()
        updates, state = tx.update(grads, state, ours)
        apply_updates(ours, updates)
    return ours, {k: r.detach() for k, r in refs.items()}, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_torch_adamw_without_mask(dtype, weight_decay):
    params = _init_params(dtype)
    tx = adamw(1e-2, b1=0.8, b2=0.95, eps=1e-6, weight_decay=weight_decay, mask=None)
    groups = [{"params": list(params), "weight_decay": weight_decay}]
    ours, ref, state = _run_both(tx, groups, params)
    for k in params:
        if weight_decay == 0.0:
            # Same kernels in the same order: bit-identical (the module docstring's claim).
            assert torch.equal(ours[k], ref[k]), k
        else:
            torch.testing.assert_close(ours[k], ref[k], rtol=TOL[dtype], atol=TOL[dtype])
    assert int(state.count) == STEPS


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_default_mask_matches_torch_with_two_param_groups(dtype):
    params = _init_params(dtype)
    decay = [k for k, p in params.items() if default_decay_mask(k, p)]
    no_decay = [k for k in params if k not in decay]
    assert decay == ["model.layers.0.mlp.up_proj.weight", "lm_head.weight"]
    groups = [{"params": decay, "weight_decay": 0.3}, {"params": no_decay, "weight_decay": 0.0}]
    tx = adamw(1e-2, b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.3)
    ours, ref, _ = _run_both(tx, groups, params)
    for k in params:
        torch.testing.assert_close(ours[k], ref[k], rtol=TOL[dtype], atol=TOL[dtype])


def test_pytree_mask_and_schedule_match_torch():
    params = _init_params(torch.float64)
    mask = {k: k.startswith("lm_head") for k in params}
    groups = [
        {"params": ["lm_head.weight"], "weight_decay": 0.2},
        {"params": [k for k in params if k != "lm_head.weight"], "weight_decay": 0.0},
    ]

    def schedule(count: int) -> float:
        return 1e-2 * (count + 1) / STEPS

    tx = adamw(schedule, b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.2, mask=mask)
    ours, ref, state = _run_both(tx, groups, params, lr_per_step=schedule)
    for k in params:
        torch.testing.assert_close(ours[k], ref[k], rtol=1e-12, atol=1e-12)
    assert math.isclose(float(state.lr), schedule(STEPS - 1))


def test_update_is_in_place_and_state_is_a_tensor_pytree():
    params = {"w": torch.randn(3, 2), "b": torch.randn(2)}
    tx = adamw(1e-3)
    state = tx.init(params)
    assert isinstance(state, AdamWState)
    assert all(isinstance(x, torch.Tensor) for x in tree_leaves(state))
    assert state.count.device.type == "cpu" and state.count.dtype == torch.int64
    assert state.count.dim() == 0 and int(state.count) == 0 and float(state.lr) == 0.0
    grads = {"w": torch.randn(3, 2), "b": torch.randn(2)}
    grad_tensors, g0 = dict(grads), {k: g.clone() for k, g in grads.items()}
    before = [id(x) for x in tree_leaves(state)]
    updates, new_state = tx.update(grads, state, params)
    assert all(updates[k] is grad_tensors[k] for k in grads)
    assert [id(x) for x in tree_leaves(new_state)] == before
    assert int(new_state.count) == 1 and float(new_state.lr) == 1e-3
    # First Adam step is -lr * sign(g) (up to eps); decay adds -lr*wd*w on the matrix only.
    expected_w = -1e-3 * g0["w"].sign() - 1e-3 * 0.01 * params["w"]
    torch.testing.assert_close(updates["w"], expected_w, rtol=1e-4, atol=1e-8)
    torch.testing.assert_close(updates["b"], -1e-3 * g0["b"].sign(), rtol=1e-4, atol=0)


def test_moments_keep_the_param_dtype():
    params = {
        "w": torch.randn(4, 4, dtype=torch.bfloat16),
        "v": torch.randn(4, dtype=torch.float32),
    }
    state = adamw(1e-3).init(params)
    assert state.mu["w"].dtype == torch.bfloat16 and state.nu["v"].dtype == torch.float32
    grads = {"w": torch.randn(4, 4, dtype=torch.bfloat16), "v": torch.randn(4)}
    updates, _ = adamw(1e-3).update(grads, state, params)
    assert updates["w"].dtype == torch.bfloat16 and torch.isfinite(updates["w"].float()).all()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": "1e-3"}, "lr must be a real number"),
        ({"lr": -1.0}, "lr must be finite and >= 0"),
        ({"lr": 1e-3, "b1": 1.0}, r"b1 must be in \[0, 1\)"),
        ({"lr": 1e-3, "b2": -0.1}, r"b2 must be in \[0, 1\)"),
        ({"lr": 1e-3, "eps": -1e-8}, "eps must be finite"),
        ({"lr": 1e-3, "weight_decay": math.nan}, "weight_decay must be finite"),
    ],
)
def test_bad_hyperparameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        adamw(**kwargs)


def test_bad_update_calls_raise():
    params = {"w": torch.ones(2, 2)}
    tx = adamw(1e-3)
    state = tx.init(params)
    with pytest.raises(ValueError, match="needs the params"):
        tx.update({"w": torch.ones(2, 2)}, state, None)
    with pytest.raises(ValueError, match="updates must have the structure"):
        tx.update({"v": torch.ones(2, 2)}, state, params)
    with pytest.raises(TypeError, match="expected a bool"):
        adamw(1e-3, mask=lambda path, t: "yes").init(params)
    bad_schedule = adamw(lambda count: math.nan)
    with pytest.raises(ValueError, match="lr schedule returned a bad value at step 0"):
        bad_schedule.update({"w": torch.ones(2, 2)}, bad_schedule.init(params), params)


def test_no_weight_decay_needs_no_params():
    tx = adamw(1e-3, weight_decay=0.0)
    state = tx.init({"w": torch.ones(2)})
    updates, _ = tx.update({"w": torch.ones(2)}, state, None)
    torch.testing.assert_close(updates["w"], torch.full((2,), -1e-3), rtol=1e-5, atol=0)


class _DTensorOps(TorchDispatchMode):
    """Counts the ops that reach the dispatcher with a DTensor operand (a mode sees an op before
    DTensor's own dispatch does): zero means the math ran on plain local tensors."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(isinstance(x, DTensor) for x in tree_leaves((args, kwargs or {}))):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _sharded_step_worker() -> list[str]:
    """Three AdamW steps (+ apply_updates) over FSDP2-style Shard(0) and replicated DTensors on
    this rank, checked against the same steps on plain tensors; returns failures."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(0)
    init = _init_params(torch.float32)  # leaves of 5, 6 and 4 rows: uneven Shard(0) included
    place = {k: [Shard(0)] if k != "model.norm.weight" else [Replicate()] for k in init}
    failures = []
    for mode in ("local", "mixed"):
        tx = adamw(1e-2, b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.1)
        dense = {k: v.clone() for k, v in init.items()}
        sharded = {k: distribute_tensor(v.clone(), mesh, place[k]) for k, v in init.items()}
        s_dense, s_sharded = tx.init(dense), tx.init(sharded)
        ops = _DTensorOps()
        for _ in range(3):
            g = _grads(init, gen)
            u, s_dense = tx.update({k: v.clone() for k, v in g.items()}, s_dense, dense)
            apply_updates(dense, u)
            g_sharded = {k: distribute_tensor(v, mesh, place[k]) for k, v in g.items()}
            if mode == "mixed":
                # a replicated gradient for a sharded parameter: placements differ, so this leaf
                # must stay on DTensors (which redistribute it), the others still go local
                g_sharded["lm_head.weight"] = distribute_tensor(
                    g["lm_head.weight"], mesh, [Replicate()]
                )
            with ops:
                u, s_sharded = tx.update(g_sharded, s_sharded, sharded)
                apply_updates(sharded, u)
        for k in init:
            # same per-element kernels on each shard: bit-identical to the unsharded step
            if not torch.equal(sharded[k].full_tensor(), dense[k]):
                failures.append(f"{mode}: {k} differs from the single-process step")
        if mode == "local" and ops.count:
            failures.append(f"local: {ops.count} ops dispatched on DTensors")
        if mode == "mixed" and not ops.count:
            failures.append("mixed: the mixed-placement leaf did not take the DTensor path")
    return failures


def test_sharded_step_runs_on_local_shards_and_matches_one_process():
    # Two gloo ranks; the mixed case also shows that the op counter sees DTensor ops.
    assert spawn(_sharded_step_worker, 2) == [[], []]
