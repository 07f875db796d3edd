"""The weighted cross entropy on the transformers backend: one process against the float64 HF
model, padded and packed (per-token scales split with their tokens)."""

import pytest
import torch

import twinkle_fn as tf
from twinkle_fn.data import pack, pad_collate
from twinkle_fn.testing import random_features, tiny_config, weighted_ce_reference, with_loss_scale


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_weighted_cross_entropy_equals_its_float64_reference(layout):
    """float64 throughout: the same sums in another order (1e-10)."""
    feats = with_loss_scale(random_features(5, seed=9), seed=9)
    batch = pack(feats) if layout == "packed" else pad_collate(feats, pad_token_id=0)
    model = tf.models.from_hf_config(tiny_config("qwen2"), seed=0, device="cpu")
    model.module.to(torch.float64)
    state = tf.init(model, tf.optim.adamw(1e-2))
    grads, aux = tf.fwd_bwd(state, batch, loss=tf.losses.weighted_cross_entropy())
    module = tf.models.from_hf_config(tiny_config("qwen2"), seed=0, device="cpu").module
    want_sum, want_grads = weighted_ce_reference(module.to(torch.float64), feats)
    assert int(aux["num_tokens"]) == sum(x != -100 for f in feats for x in f["labels"])
    torch.testing.assert_close(aux["loss_sum"], want_sum, rtol=1e-10, atol=1e-10)
    assert grads.params.keys() == want_grads.keys()
    for name, grad in grads.params.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-10, atol=1e-10, msg=name)
