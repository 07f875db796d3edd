"""The transformers backend's checkpoint layout: what it refuses, before writing anything.

Round trips, foreign and damaged checkpoints are tested through the API in
`twinkle_fn/checkpoint_test.py`; here, what only this layout has."""

import pytest
import torch

import twinkle_fn as tf
from twinkle_fn.pytree import tree_leaves
from twinkle_fn.testing import tiny_config


def _moe_state(seed):
    model = tf.models.from_hf_config(tiny_config("qwen3_moe"), seed=seed, device="cpu")
    return tf.init(model, tf.optim.adamw(1e-2))


def test_an_unsharded_moe_checkpoint_is_refused_before_anything_is_written(tmp_path):
    """Qwen3-MoE's module fuses its experts, its HF files keep one tensor per expert: an
    unsharded checkpoint cannot restore them from the files alone, so it is refused (naming
    the fused parameters) and the state is left as it was, rather than loaded without them."""
    tf.checkpoint.save(_moe_state(0), tmp_path / "ckpt")
    state = _moe_state(1)
    before = state.copy()
    for load in (tf.checkpoint.load, tf.checkpoint.load_weights):
        with pytest.raises(ValueError, match=r"'model.layers.0.mlp.experts.gate_up_proj'"):
            load(state, tmp_path / "ckpt")
        assert not state.donated
        for a, b in zip(tree_leaves(state), tree_leaves(before), strict=True):
            assert torch.equal(a, b)
