"""What `tf.step` refuses or skips before it updates anything (`twinkle_fn.step_guards`): grads
that are not this state's, a schedule gone bad, an unknown ``on_nonfinite``, and a NaN or
infinite loss or gradient norm (raised or skipped); each leaves the state and grads usable."""

import pytest
import torch

import twinkle_fn as tf
from twinkle_fn.api_test import _state
from twinkle_fn.data import pack
from twinkle_fn.pytree import tree_leaves
from twinkle_fn.testing import random_features, tiny_config


def _poisoned(state, value):
    """Grads of one batch with `value` (NaN or inf) written into one gradient entry."""
    grads, _ = tf.fwd_bwd(state, pack(random_features(2, seed=4)))
    next(iter(grads.params.values())).view(-1)[0] = value
    return grads


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_step_raises_naming_step_and_value_and_leaves_state_usable(value):
    state = tf.step(_state(), tf.fwd_bwd(_state(), pack(random_features(2)))[0])[0]
    before = state.copy()
    grads = _poisoned(state, value)
    unguarded = tf.step(state, grads, donate=False)[1]  # the default checks nothing
    assert not torch.isfinite(unguarded["grad_norm"])
    with pytest.raises(tf.NonFiniteError, match=r"step 1: .*gradient norm (nan|inf)"):
        tf.step(state, grads, on_nonfinite="raise")
    assert not state.donated and not grads.donated
    for a, b in zip(tree_leaves(state), tree_leaves(before), strict=True):
        assert torch.equal(a, b)
    tf.step(state, tf.fwd_bwd(state, pack(random_features(2)))[0])  # still usable


def test_nonfinite_step_skips_on_request():
    state = _state()
    before = state.copy()
    new, info = tf.step(state, _poisoned(state, float("nan")), on_nonfinite="skip")
    assert info["skipped"] and not torch.isfinite(info["grad_norm"])
    assert int(new.step) == 0 and not torch.equal(new.rng, before.rng)
    for name, p in new.params.items():
        assert torch.equal(p, before.params[name]), name
    for a, b in zip(tree_leaves(new.opt_state), tree_leaves(before.opt_state), strict=True):
        assert torch.equal(a, b)


def test_unknown_on_nonfinite_is_named_before_anything_is_donated():
    state = _state()
    grads, _ = tf.fwd_bwd(state, pack(random_features(2)))
    with pytest.raises(ValueError, match=r"on_nonfinite must be one of .*'ignore'"):
        tf.step(state, grads, on_nonfinite="ignore")
    assert not state.donated and not grads.donated


def _assert_intact(state, before, grads=None, grads_before=None):
    """`state` (and `grads`) live and bit-identical to the copies taken before, and a real step
    still runs from them."""
    assert not state.donated
    for a, b in zip(tree_leaves(state), tree_leaves(before), strict=True):
        assert torch.equal(a, b)
    if grads is not None:
        assert not grads.donated
        for a, b in zip(tree_leaves(grads), tree_leaves(grads_before), strict=True):
            assert torch.equal(a, b)
    tf.step(state, tf.fwd_bwd(state, pack(random_features(2)))[0])


@pytest.mark.parametrize(
    ("bad", "shown"), [(float("nan"), "nan"), (float("inf"), "inf"), (-1e-3, "-0.001")]
)
def test_a_schedule_that_goes_bad_is_refused_before_anything_is_donated(bad, shown):
    """A schedule fine at step 0 and bad at step 1: the second step names the step and the
    value, and neither the state nor the grads were touched (clipping and the token division
    happen in place, so a late refusal would have changed the grads)."""
    tx = tf.optim.chain(
        tf.optim.clip_by_global_norm(1e-3), tf.optim.adamw(lambda n: 1e-2 if n == 0 else bad)
    )
    model = tf.models.from_hf_config(tiny_config(), seed=0)
    state = tf.init(model, tx)
    state, _ = tf.step(state, tf.fwd_bwd(state, pack(random_features(2)))[0])
    grads, _ = tf.fwd_bwd(state, pack(random_features(2, seed=1)))
    before, grads_before = state.copy(), grads.copy()
    with pytest.raises(ValueError, match=rf"tf.step at step 1: .*bad value at step 1.*{shown}"):
        tf.step(state, grads)
    with pytest.raises(ValueError, match=r"tf\.step at step 1"):
        tf.step(state, grads)  # refused again: the first refusal changed nothing
    sane = tf.optim.chain(tf.optim.clip_by_global_norm(1e-3), tf.optim.adamw(1e-2))
    state = state.replace(tx=sane)  # the same state tree, a sane schedule
    _assert_intact(state, before, grads, grads_before)


def test_step_without_grads_or_with_other_grads_names_the_problem():
    state = _state()
    before = state.copy()
    with pytest.raises(
        TypeError, match=r"grads must be the Grads returned by tf\.fwd_bwd, got NoneType"
    ):
        tf.step(state, None)
    grads, _ = tf.fwd_bwd(state, pack(random_features(2)))
    name = next(iter(grads.params))
    fewer = grads.replace(params={n: g for n, g in grads.params.items() if n != name})
    with pytest.raises(ValueError, match=rf"missing \['{name}'\]"):
        tf.step(state, fewer)
    flat = {n: g.reshape(-1) if n == name else g for n, g in grads.params.items()}
    with pytest.raises(ValueError, match=rf"grads\['{name}'\] has shape"):
        tf.step(state, grads.replace(params=flat))
    _assert_intact(state, before)
