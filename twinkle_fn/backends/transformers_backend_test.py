import pytest
import torch

import twinkle_fn as tf
from twinkle_fn import backends
from twinkle_fn.backends.transformers_backend import TransformersBackend
from twinkle_fn.data import pack
from twinkle_fn.testing import random_features, tiny_config


def test_registry_names_and_errors():
    assert "fsdp" in backends.names()
    assert isinstance(backends.get("fsdp"), TransformersBackend)
    with pytest.raises(ValueError, match="unknown backend 'jax'"):
        backends.get("jax")


def test_prepare_is_a_no_op_on_one_process_and_trainable_follows_requires_grad():
    be = TransformersBackend()
    model = tf.models.from_hf_config(tiny_config(), seed=0, device="cpu")
    assert be.prepare(model, tf.Mesh()) is model
    model.module.get_decoder().norm.weight.requires_grad_(False)
    assert "model.norm.weight" not in be.trainable(model)


def test_update_normalises_by_the_token_count_once():
    """A batch's summed gradients divided by its token count are the mean-loss gradients."""
    be = TransformersBackend()
    model = tf.models.from_hf_config(tiny_config(), seed=0, device="cpu")
    model.module.to(torch.float64)
    state = tf.init(model, tf.optim.sgd(1.0))
    batch = pack(random_features(3))
    grads, _ = tf.fwd_bwd(state, batch)
    n = int(grads.num_tokens)
    before = {k: p.detach().clone() for k, p in state.params.items()}
    expected = {k: before[k] - g / n for k, g in grads.params.items()}
    new, info = be.update(state.replace(), grads.replace())
    for k in expected:
        torch.testing.assert_close(new.params[k], expected[k], rtol=1e-12, atol=1e-15)
    assert int(info["num_tokens"]) == n
