"""DPO and SimPO on the transformers backend: ``tf.fwd_bwd`` (a pass without gradients, then
the linearised token loss) against the float64 HF model, padded and packed; bad batches
refused before any compute. DPO on every mesh against one process: `rl_mesh_test`."""

import pytest
import torch

import twinkle_fn as tf
from twinkle_fn.data import pack, pad_collate
from twinkle_fn.testing import preference_reference, random_features, tiny_config, with_rl_fields

LOSSES = {
    "dpo": tf.losses.dpo_loss(0.5, label_smoothing=0.1),
    "simpo": tf.losses.simpo_loss(2.5, 0.5),
}


def _state(mesh=None):
    model = tf.models.from_hf_config(tiny_config("qwen2"), seed=0, device="cpu")
    model.module.to(torch.float64)
    return tf.init(model, tf.optim.adamw(1e-2), mesh)


def _batch(feats, layout):
    return pack(feats) if layout == "packed" else pad_collate(feats, pad_token_id=0)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_a_preference_loss_equals_its_float64_reference_in_value_and_gradient(name, layout):
    """float64 throughout: the same sums in another order (1e-10). The count is the pairs."""
    loss = LOSSES[name]
    feats = with_rl_fields(random_features(6, seed=7), seed=7)
    grads, aux = tf.fwd_bwd(_state(), _batch(feats, layout), loss=loss)
    module = tf.models.from_hf_config(tiny_config("qwen2"), seed=0, device="cpu").module
    want_sum, want_grads = preference_reference(module.to(torch.float64), feats, loss)
    assert int(aux["num_tokens"]) == 3
    torch.testing.assert_close(aux["loss_sum"], want_sum, rtol=1e-10, atol=1e-10)
    assert grads.params.keys() == want_grads.keys()
    for n, grad in grads.params.items():
        torch.testing.assert_close(grad, want_grads[n], rtol=1e-10, atol=1e-10, msg=n)


def test_an_odd_batch_is_refused_before_any_compute():
    """The accumulated gradients are not donated: nothing ran."""
    state, feats = _state(), with_rl_fields(random_features(5, seed=1), seed=1)
    grads, _ = tf.fwd_bwd(state, pad_collate(feats[:4], pad_token_id=0), loss=LOSSES["dpo"])
    with pytest.raises(ValueError, match="5 rows, an odd number"):
        tf.fwd_bwd(state, pad_collate(feats, pad_token_id=0), grads, loss=LOSSES["dpo"])
    grads.check_alive()
