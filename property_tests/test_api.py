"""Properties of the functional API on one process (float64, a tiny Qwen2)."""

import functools
import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import twinkle_fn as tf
from twinkle_fn.data import pack, pad_collate
from twinkle_fn.pytree import tree_leaves
from twinkle_fn.testing import random_features, tiny_config


@functools.cache
def _state():
    model = tf.models.from_hf_config(tiny_config("qwen2"), seed=0, device="cpu")
    model.module.to(torch.float64)
    return tf.init(model, tf.optim.chain(tf.optim.clip_by_global_norm(1.0), tf.optim.adamw(1e-2)))


def _collate(feats, packed):
    return pack(feats) if packed else pad_collate(feats, pad_token_id=0)


@st.composite
def _split(draw):
    n = draw(st.integers(2, 7))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1)))
    return n, [0, *cuts, n]


@settings(max_examples=15, deadline=None)
@given(split=_split(), seed=st.integers(0, 10_000), packed=st.booleans())
def test_accumulated_micro_batches_equal_one_batch(split, seed, packed):
    """Any split of a batch into micro-batches gives the one-batch grads (float64: ~1e-12)."""
    n, bounds = split
    feats = random_features(n, seed=seed)
    state = _state()
    one, _ = tf.fwd_bwd(state, _collate(feats, packed))
    acc = None
    for lo, hi in itertools.pairwise(bounds):
        acc, _ = tf.fwd_bwd(state, _collate(feats[lo:hi], packed), accum=acc)
    assert int(acc.num_tokens) == int(one.num_tokens)
    for name, g in one.params.items():
        torch.testing.assert_close(acc.params[name], g, rtol=1e-9, atol=1e-12)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), packed=st.booleans())
def test_calls_without_donation_leave_inputs_bit_identical(seed, packed):
    state = _state()
    batch = _collate(random_features(3, seed=seed), packed)
    before = [t.clone() for t in tree_leaves(state)]
    grads, _ = tf.fwd_bwd(state, batch, donate=False)
    grads_before = [t.clone() for t in tree_leaves(grads)]
    tf.step(state, grads, donate=False)
    assert all(torch.equal(a, b) for a, b in zip(before, tree_leaves(state), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(grads_before, tree_leaves(grads), strict=True))
