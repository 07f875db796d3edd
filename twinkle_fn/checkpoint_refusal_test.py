"""A refused load writes nothing: damaged or foreign checkpoints (another hidden size, family or
dtype, a missing or extra tensor, NaN bytes, a truncated file, NaN in the optimizer state) are
refused by `tf.checkpoint.load` and `load_weights`, naming the tensor and the file, and any failed
load or `tf.step` leaves its input state usable and bit-identical."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import twinkle_fn as tf
from twinkle_fn.checkpoint_test import _state
from twinkle_fn.data import pack
from twinkle_fn.pytree import tree_leaves
from twinkle_fn.testing import random_features, tiny_config

Q = "model.layers.0.self_attn.q_proj.weight"


def _edit_weights(path, edit):
    """Rewrite the checkpoint's ``model.safetensors`` with `edit` applied to its tensors."""
    file = path / "model.safetensors"
    tensors = edit(load_file(file))
    save_file(tensors, file, metadata={"format": "pt"})


def _nan(tensors):
    tensors[Q][0, 0] = float("nan")
    return tensors


def _truncate(path):
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])


def _opt_nan(path):
    meta = torch.load(path / "twinkle_state.pt", weights_only=True)
    meta["opt_leaves"][-1].view(-1)[0] = float("inf")
    torch.save(meta, path / "twinkle_state.pt")


def _foreign(**overrides):
    """Save a state of another config (qwen2 with `overrides`, or a llama) as a directory maker."""

    def make(path):
        family = overrides.pop("family", "qwen2")
        model = tf.models.from_hf_config(tiny_config(family, **overrides), seed=0, device="cpu")
        tf.checkpoint.save(
            tf.init(model, tf.optim.chain(tf.optim.clip_by_global_norm(1.0), tf.optim.adamw(1e-2))),
            path,
        )

    return make


DAMAGES = {
    "another hidden size": (
        _foreign(hidden_size=64),
        r"tensor 'model.embed_tokens.weight' has shape \(96, 64\) in .*model\.safetensors, "
        r"the model expects \(96, 32\)",
    ),
    "another family": (
        _foreign(family="llama"),
        r"holds a 'llama' model \(config.json\), this state a 'qwen2' one",
    ),
    "a missing tensor": (
        lambda p: _edit_weights(
            p, lambda t: {k: v for k, v in t.items() if k != "model.norm.weight"}
        ),
        r"lacks 1 tensors the model has, e.g. \['model.norm.weight'\]",
    ),
    "an extra tensor": (
        lambda p: _edit_weights(
            p, lambda t: {**t, "model.layers.2.mlp.up_proj.weight": t[Q].clone()}
        ),
        r"holds 1 tensors the model lacks, e.g. \['model.layers.2.mlp.up_proj.weight'\]",
    ),
    "NaN bytes": (
        lambda p: _edit_weights(p, _nan),
        rf"tensor '{Q}' in .*model\.safetensors holds NaN",
    ),
    "a truncated file": (_truncate, r"model\.safetensors: tensor .* the file is truncated"),
}


def _damaged(root, what):
    """A checkpoint of `_state()` damaged by `what` (built once per name under `root`)."""
    path = root / what.replace(" ", "_")
    if not path.exists():
        if what in ("another hidden size", "another family"):
            DAMAGES[what][0](path)
        else:
            tf.checkpoint.save(_state(), path)
            {**{k: v[0] for k, v in DAMAGES.items()}, **EXTRA_DAMAGES}[what](path)
    return path


EXTRA_DAMAGES = {
    "another dtype": lambda p: _edit_weights(
        p, lambda t: {**t, "model.norm.weight": t["model.norm.weight"].half()}
    ),
    "NaN in the optimizer state": _opt_nan,
}


def _assert_intact(state, before):
    """`state` is live, bit-identical to `before`, and takes a real step (returned)."""
    assert not state.donated
    for a, b in zip(tree_leaves(state), tree_leaves(before), strict=True):
        assert torch.equal(a, b)
    return tf.step(state, tf.fwd_bwd(state, pack(random_features(2)))[0])[0]


@pytest.fixture(scope="module")
def damaged_root(tmp_path_factory):
    return tmp_path_factory.mktemp("damaged")


@pytest.mark.parametrize("what", list(DAMAGES))
@pytest.mark.parametrize("how", ["load", "load_weights"])
def test_a_foreign_or_damaged_checkpoint_is_refused_before_anything_is_written(
    damaged_root, what, how
):
    path = _damaged(damaged_root, what)
    state = _state(seed=1)
    before = state.copy()
    load = tf.checkpoint.load if how == "load" else tf.checkpoint.load_weights
    with pytest.raises(ValueError, match=DAMAGES[what][1]):
        load(state, path)
    _assert_intact(state, before)


def test_another_dtype_is_refused_by_load_and_cast_by_load_weights(damaged_root):
    """A checkpoint of this state holds its dtypes; an HF release may hold any float dtype."""
    path = _damaged(damaged_root, "another dtype")
    state = _state(seed=1)
    before = state.copy()
    with pytest.raises(
        ValueError, match=r"'model.norm.weight' is torch.float16 in .*expects torch.float32"
    ):
        tf.checkpoint.load(state, path)
    state = _assert_intact(state, before)
    tf.checkpoint.load_weights(state, path)
    assert torch.equal(
        state.params["model.norm.weight"],
        load_file(path / "model.safetensors")["model.norm.weight"].float(),
    )


def test_nan_in_the_optimizer_state_is_refused(damaged_root):
    path = _damaged(damaged_root, "NaN in the optimizer state")
    state = _state(seed=1)
    before = state.copy()
    with pytest.raises(ValueError, match=r"tensor '.*' holds NaN or infinity"):
        tf.checkpoint.load(state, path)
    _assert_intact(state, before)


def _scheduled(steps, bad_at):
    """A state after `steps` steps whose schedule gives NaN from step `bad_at` on."""
    model = tf.models.from_hf_config(tiny_config(), seed=1, device="cpu")
    schedule = lambda n: 1e-2 if n < bad_at else float("nan")  # noqa: E731
    tx = tf.optim.chain(tf.optim.clip_by_global_norm(1.0), tf.optim.adamw(schedule))
    state = tf.init(model, tx)
    for i in range(steps):
        state, _ = tf.step(state, tf.fwd_bwd(state, pack(random_features(2, seed=i)))[0])
    return state


def _other_grads(state):
    small = tf.models.from_hf_config(tiny_config(intermediate_size=32), seed=0, device="cpu")
    other = tf.init(small, tf.optim.adamw(1e-2))
    return tf.fwd_bwd(other, pack(random_features(2)))[0]


def _poisoned(state):
    grads = tf.fwd_bwd(state, pack(random_features(2)))[0]
    grads.params[Q].view(-1)[0] = float("nan")
    return grads


STEP_FAILURES = {
    "schedule turns NaN": lambda s: tf.step(s, tf.fwd_bwd(s, pack(random_features(2)))[0]),
    "no grads": lambda s: tf.step(s, None),
    "grads of another model": lambda s: tf.step(s, _other_grads(s)),
    "non-finite grads": lambda s: tf.step(s, _poisoned(s), on_nonfinite="raise"),
}
LOAD_FAILURES = [*DAMAGES, *EXTRA_DAMAGES]


@settings(max_examples=10, deadline=None)
@given(
    failure=st.sampled_from(
        [("step", f) for f in STEP_FAILURES]
        + [(how, d) for how in ("load", "load copy") for d in LOAD_FAILURES]
        + [("load_weights", d) for d in DAMAGES]  # it casts dtypes, reads no optimizer state
    ),
    steps=st.integers(0, 2),
)
def test_any_failed_load_or_step_leaves_its_input_usable_and_bit_identical(
    damaged_root, failure, steps
):
    """Invariant 7's last clause as a property: whatever raises inside `tf.checkpoint.load`,
    `load_weights` or `tf.step`, on a state of any age, the state is not donated, every tensor
    of it (parameters, optimizer state, step, RNG key) is bit-identical, and a real step runs."""
    how, what = failure
    state = _scheduled(steps, bad_at=steps if what == "schedule turns NaN" else 10**9)
    before = state.copy()
    with pytest.raises((ValueError, TypeError, tf.NonFiniteError)):
        if how == "step":
            STEP_FAILURES[what](state)
        elif how == "load_weights":
            tf.checkpoint.load_weights(state, _damaged(damaged_root, what))
        else:
            tf.checkpoint.load(state, _damaged(damaged_root, what), donate=how == "load")
    assert not state.donated
    for a, b in zip(tree_leaves(state), tree_leaves(before), strict=True):
        assert torch.equal(a, b)
    sane = tf.optim.chain(tf.optim.clip_by_global_norm(1.0), tf.optim.adamw(1e-2))
    state = state.replace(tx=sane)
    new, info = tf.step(state, tf.fwd_bwd(state, pack(random_features(2)))[0])
    assert int(new.step) == steps + 1 and torch.isfinite(info["loss"])
