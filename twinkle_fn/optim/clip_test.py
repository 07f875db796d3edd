import pytest
import torch
from torch.overrides import TorchFunctionMode

from twinkle_fn.optim import EmptyState, clip_by_global_norm
from twinkle_fn.optim.base import ScaledUpdates, materialise
from twinkle_fn.pytree import tree_global_norm, tree_leaves


def _grads(scale):
    gen = torch.Generator().manual_seed(0)
    return {
        "a": scale * torch.randn(7, 5, generator=gen),
        "b": {"c": scale * torch.randn(11, generator=gen)},
    }


def _torch_clipped(grads, max_norm):
    """Reference: torch.nn.utils.clip_grad_norm_ on parameters carrying these grads."""
    params = []
    for g in tree_leaves(grads):
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    return [p.grad for p in params]


@pytest.mark.parametrize("scale", [0.01, 1.0, 100.0])
def test_matches_torch_clip_grad_norm(scale):
    grads = _grads(scale)
    expected = _torch_clipped(grads, max_norm=1.0)
    before = tree_leaves(grads)
    tx = clip_by_global_norm(1.0)
    updates, state = tx.update(grads, tx.init(grads))
    assert state == EmptyState()
    leaves = tree_leaves(updates)
    assert all(u is b for u, b in zip(leaves, before, strict=True))  # scaled in place
    # Same float32 norm and scale as torch, so the results agree to float32 rounding.
    for u, e in zip(leaves, expected, strict=True):
        torch.testing.assert_close(u, e, rtol=1e-6, atol=1e-7)


def test_small_updates_pass_through_unchanged_and_large_ones_hit_max_norm():
    small = _grads(0.01)
    copy = [t.clone() for t in tree_leaves(small)]
    tx = clip_by_global_norm(1.0)
    out, _ = tx.update(small, tx.init(small))
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(out), copy, strict=True))
    big, _ = tx.update(_grads(100.0), EmptyState())
    assert abs(tree_global_norm(big).item() - 1.0) < 1e-5  # float32 norm of the rescaled tree


def test_mixed_dtypes_are_scaled_by_the_same_factor():
    grads = {"a": torch.full((4,), 3.0), "b": torch.full((4,), 4.0, dtype=torch.bfloat16)}
    tx = clip_by_global_norm(5.0)
    out, _ = tx.update(grads, tx.init(grads))  # global norm 10 -> scale ~0.5
    torch.testing.assert_close(out["a"], torch.full((4,), 1.5), rtol=1e-6, atol=0)
    assert out["b"].dtype == torch.bfloat16
    torch.testing.assert_close(out["b"].float(), torch.full((4,), 2.0), rtol=1e-2, atol=0)


class _NoHostReads(TorchFunctionMode):
    """Fails on any tensor -> Python conversion (each is a device sync on an accelerator)."""

    FORBIDDEN = (
        torch.Tensor.item,
        torch.Tensor.tolist,
        torch.Tensor.__bool__,
        torch.Tensor.__float__,
        torch.Tensor.__int__,
        torch.Tensor.__index__,
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.FORBIDDEN:
            raise AssertionError(f"host read of a tensor value: {func.__name__}")
        return func(*args, **(kwargs or {}))


def test_update_reads_no_tensor_value_on_the_host():
    grads = _grads(100.0)
    tx = clip_by_global_norm(1.0)
    with _NoHostReads():
        tx.update(grads, tx.init(grads))
        tx.update(ScaledUpdates(grads, torch.tensor(0.5)), EmptyState())
    with pytest.raises(AssertionError, match="host read"), _NoHostReads():
        bool(grads["a"].sum() > 0)  # the guard does catch a Python branch on a tensor


@pytest.mark.parametrize("max_norm", [0.0, -1.0, float("nan"), "1.0"])
def test_bad_max_norm_raises(max_norm):
    with pytest.raises(ValueError, match="max_norm"):
        clip_by_global_norm(max_norm)


@pytest.mark.parametrize("scale", [0.001, 1.0, 30.0])
@pytest.mark.parametrize("given_norm", [False, True])
def test_a_pending_scale_is_clipped_as_if_multiplied_in(scale, given_norm):
    """The clip of a `ScaledUpdates` leaves its tree untouched and folds the factor into the
    pending scale; multiplied in, it is the clip of the multiplied tree (float32 rounding: the
    norm is the tree's times the scale, not the norm of the rounded products)."""
    grads = _grads(1.0)
    copy = [t.clone() for t in tree_leaves(grads)]
    expected, _ = clip_by_global_norm(1.0).update(
        {"a": grads["a"] * scale, "b": {"c": grads["b"]["c"] * scale}}, EmptyState()
    )
    norm = tree_global_norm(grads) if given_norm else None
    pending = ScaledUpdates(grads, torch.tensor(scale, dtype=torch.float64), norm)
    out, state = clip_by_global_norm(1.0).update(pending, EmptyState())
    assert state == EmptyState() and isinstance(out, ScaledUpdates) and out.tree is grads
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(grads), copy, strict=True))
    for u, e in zip(tree_leaves(materialise(out)), tree_leaves(expected), strict=True):
        torch.testing.assert_close(u, e, rtol=2e-6, atol=0)


def test_a_given_norm_is_not_measured_again():
    grads = _grads(1.0)
    true = tree_global_norm(grads)
    out, _ = clip_by_global_norm(1.0).update(
        ScaledUpdates(grads, torch.tensor(1.0), 2 * true), EmptyState()
    )
    torch.testing.assert_close(out.scale, 1.0 / (2 * true + 1e-6))
