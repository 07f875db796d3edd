import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from twinkle_fn.optim import (
    EmptyState,
    GradientTransformation,
    adamw,
    apply_updates,
    chain,
    clip_by_global_norm,
    current_lr,
    sgd,
)
from twinkle_fn.optim.base import (
    ScaledUpdates,
    check_lr,
    foreach_groups,
    local_operands,
    materialise,
    pending_scale,
)
from twinkle_fn.pytree import tree_global_norm, tree_leaves
from twinkle_fn.testing_dist import spawn


def _affine(scale: float, shift: float) -> GradientTransformation:
    """A stateless test transformation: u <- scale * u + shift, in place."""

    def update(updates, state, params=None):
        for u in tree_leaves(updates):
            u.mul_(scale).add_(shift)
        return updates, state

    return GradientTransformation(lambda params: EmptyState(), update)


def test_chain_composes_left_to_right():
    for txs, expected in [
        ((_affine(2.0, 0.0), _affine(1.0, 1.0)), 2.0 * 3.0 + 1.0),
        ((_affine(1.0, 1.0), _affine(2.0, 0.0)), 2.0 * (3.0 + 1.0)),
    ]:
        tx = chain(*txs)
        state = tx.init({"w": torch.zeros(2)})
        assert state == (EmptyState(), EmptyState())
        updates, new_state = tx.update({"w": torch.full((2,), 3.0)}, state)
        assert torch.equal(updates["w"], torch.full((2,), expected))
        assert isinstance(new_state, tuple) and len(new_state) == 2


def test_empty_chain_is_identity():
    tx = chain()
    g = {"w": torch.arange(3.0)}
    updates, state = tx.update(g, tx.init(g))
    assert state == () and torch.equal(updates["w"], torch.arange(3.0))


def test_materialise_multiplies_a_pending_scale_in_place_and_passes_plain_updates():
    g = {"w": torch.arange(4.0), "b": torch.ones(2, dtype=torch.float64)}
    assert materialise(g) is g and torch.equal(g["w"], torch.arange(4.0))
    w = g["w"]
    out = materialise(ScaledUpdates(g, torch.tensor(0.5, dtype=torch.float64)))
    assert out is g and out["w"] is w
    assert torch.equal(w, torch.arange(4.0) / 2) and torch.equal(g["b"], torch.full((2,), 0.5))


def test_pending_scale_leaves_the_tree_and_gives_the_scaled_values_norm():
    g = {"w": torch.tensor([3.0, 4.0]), "b": torch.tensor([12.0])}  # norm 13
    updates, norm = pending_scale(g, torch.tensor(0.5, dtype=torch.float64))
    assert updates.tree is g and torch.equal(g["w"], torch.tensor([3.0, 4.0]))
    assert updates.norm == 13.0 and norm.dtype == torch.float32 and norm == 6.5
    torch.testing.assert_close(norm, tree_global_norm(materialise(updates)))


def test_chain_hands_a_pending_scale_on_only_to_members_that_take_one():
    """clip takes the scale (no pass of its own); a member that does not gets the tree
    multiplied first, and the chain returns plain updates."""
    seen = []

    def record(updates, state, params=None):
        seen.append(updates)
        return updates, state

    plain = GradientTransformation(lambda params: EmptyState(), record)
    takes = chain(clip_by_global_norm(1.0), plain)
    assert takes.takes_scaled and not chain(plain, clip_by_global_norm(1.0)).takes_scaled
    assert not chain().takes_scaled
    g = {"w": torch.tensor([3.0, 4.0])}  # norm 5, times 0.4: 2, clipped to 1
    out, _ = takes.update(ScaledUpdates(g, torch.tensor(0.4)), takes.init(g))
    assert seen == [g] and out is g
    torch.testing.assert_close(g["w"], torch.tensor([0.6, 0.8]))
    last_takes = chain(plain, clip_by_global_norm(1.0))
    out, _ = last_takes.update(g, last_takes.init(g))
    assert out is g and not isinstance(out, ScaledUpdates)


def test_chain_rejects_bad_arguments_and_state():
    with pytest.raises(TypeError, match="argument 1"):
        chain(sgd(0.1), "adamw")
    tx = chain(sgd(0.1), clip_by_global_norm(1.0))
    with pytest.raises(ValueError, match="tuple of 2 states"):
        tx.update({"w": torch.ones(2)}, (EmptyState(),), {"w": torch.ones(2)})


def test_chain_of_clip_and_sgd_matches_torch():
    # Reference: torch's clip_grad_norm_ followed by torch.optim.SGD, in float32 (tree_global_norm
    # computes norms in float32); the sgd step rounds differently from torch's fused add by ~1 ulp.
    gen = torch.Generator().manual_seed(0)
    init = {"w": torch.randn(4, 3, generator=gen)}
    ref = torch.nn.Parameter(init["w"].clone())
    opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9)
    params = {"w": init["w"].clone()}
    tx = chain(clip_by_global_norm(0.5), sgd(0.1, momentum=0.9))
    state = tx.init(params)
    for _ in range(4):
        g = 3.0 * torch.randn(4, 3, generator=gen)
        ref.grad = g.clone()
        torch.nn.utils.clip_grad_norm_([ref], 0.5)
        opt.step()
        updates, state = tx.update({"w": g.clone()}, state, params)
        apply_updates(params, updates)
    torch.testing.assert_close(params["w"], ref.detach(), rtol=1e-6, atol=1e-6)


def test_apply_updates_is_in_place_and_returns_params():
    w = torch.nn.Parameter(torch.ones(2, 2))
    b = torch.zeros(3, dtype=torch.float64)
    params = {"w": w, "b": b}
    out = apply_updates(params, {"w": torch.full((2, 2), 0.5), "b": torch.arange(3.0).double()})
    assert out is params and out["w"] is w and out["b"] is b
    assert torch.equal(w.detach(), torch.full((2, 2), 1.5))
    assert torch.equal(b, torch.arange(3.0).double())
    assert w.requires_grad


def test_apply_updates_rejects_mismatched_trees():
    with pytest.raises(ValueError, match="updates must have the structure"):
        apply_updates({"w": torch.ones(2)}, {"v": torch.ones(2)})
    with pytest.raises(ValueError, match="leaf 0 is a float"):
        apply_updates({"w": torch.ones(2)}, {"w": 1.0})


def test_current_lr_reports_the_last_updates_lr():
    params = {"w": torch.ones(3)}

    def schedule(count: int) -> float:
        return 0.1 * (count + 1)

    tx = chain(clip_by_global_norm(1.0), adamw(schedule))
    state = tx.init(params)
    assert current_lr(state) is None  # no update applied yet
    for expected in (0.1, 0.2, 0.3):
        _, state = tx.update({"w": torch.ones(3)}, state, params)
        assert math.isclose(current_lr(state), expected)
    assert current_lr(((EmptyState(),), state)) == current_lr(state)
    assert current_lr(chain(clip_by_global_norm(1.0)).init(params)) is None


def test_next_lr_previews_the_coming_update_and_refuses_a_bad_schedule():
    params = {"w": torch.ones(3)}
    tx = chain(clip_by_global_norm(1.0), sgd(lambda count: [0.5, math.nan][count]))
    state = tx.init(params)
    assert tx.next_lr(state) == 0.5
    _, state = tx.update({"w": torch.ones(3)}, state, params)
    with pytest.raises(ValueError, match="bad value at step 1: lr must be finite"):
        tx.next_lr(state)
    assert chain(clip_by_global_norm(1.0)).next_lr((EmptyState(),)) is None


def test_foreach_groups_splits_by_dtype_in_order():
    ts = [
        torch.ones(1),
        torch.ones(1, dtype=torch.float64),
        torch.ones(2),
        torch.ones(1).bfloat16(),
    ]
    assert foreach_groups(ts) == [[0, 2], [1], [3]]


@pytest.mark.parametrize(
    ("lr", "match"),
    [
        ("1e-3", "real number"),
        (True, "real number"),
        (-1.0, ">= 0"),
        (math.inf, ">= 0"),
        (0.0, "> 0, got 0.0: a learning rate of 0 never changes the weights; pass a positive"),
        (0, "> 0, got 0.0"),
    ],
)
def test_check_lr_rejects_bad_values(lr, match):
    with pytest.raises(ValueError, match=f"lr must be .*{match}"):
        check_lr(lr)


def _sharded_worker() -> None:
    """Run on each of `spawn`'s gloo ranks, whose process group it uses."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(0)
    init = {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(6, generator=gen)}
    for tx in (
        chain(clip_by_global_norm(0.5), adamw(1e-2, weight_decay=0.1)),
        sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.1),
    ):
        dense = {k: v.clone() for k, v in init.items()}
        sharded = {k: distribute_tensor(v.clone(), mesh, [Shard(0)]) for k, v in init.items()}
        s_dense, s_sharded = tx.init(dense), tx.init(sharded)
        for _ in range(3):
            g = {k: 5.0 * torch.randn(v.shape, generator=gen) for k, v in init.items()}
            u, s_dense = tx.update({k: v.clone() for k, v in g.items()}, s_dense, dense)
            apply_updates(dense, u)
            g_sharded = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in g.items()}
            u, s_sharded = tx.update(g_sharded, s_sharded, sharded)
            apply_updates(sharded, u)
        for k in init:
            # Same elementwise kernels on each shard; the global norm is all-reduced.
            torch.testing.assert_close(sharded[k].full_tensor(), dense[k], rtol=1e-6, atol=1e-7)


def test_transformations_work_on_sharded_dtensors():
    # FSDP2 hands the optimizer DTensor shards: every kernel must have a DTensor rule, and the
    # clip norm must cover all shards (two gloo processes, Shard(0)).
    spawn(_sharded_worker, 2)


def test_local_operands_passes_plain_tensors_and_checks_lengths():
    a, b = [torch.ones(2), torch.zeros(3)], [torch.ones(2), None]
    out = local_operands(a, b)
    assert all(x is y for x, y in zip(out[0] + out[1], a + b, strict=True))
    with pytest.raises(ValueError, match="columns differ in length"):
        local_operands(a, [torch.ones(2)])
