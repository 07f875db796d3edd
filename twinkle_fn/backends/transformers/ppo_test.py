"""The PPO / GRPO loss on the transformers backend: one process against the float64 HF model.
Every mesh against one process: `rl_mesh_test`."""

import pytest
import torch

import twinkle_fn as tf
from twinkle_fn.data import pack, pad_collate
from twinkle_fn.testing import ppo_reference, random_features, tiny_config, with_rl_fields

# every option on: asymmetric clip, k3 KL, entropy bonus, TIS cap, sequence-mean weights
PPO = tf.losses.ppo_loss(
    0.2, 0.28, beta=0.1, entropy_coef=0.01, tis_cap=1.5, aggregation="seq_mean_token_mean"
)


def _state(mesh=None):
    model = tf.models.from_hf_config(tiny_config("qwen2"), seed=0, device="cpu")
    model.module.to(torch.float64)
    return tf.init(model, tf.optim.adamw(1e-2), mesh)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_ppo_loss_equals_its_float64_reference_in_value_and_gradient(layout):
    """float64 throughout: the same sums in another order (1e-10)."""
    feats = with_rl_fields(random_features(5, seed=7), seed=7)
    batch = pack(feats) if layout == "packed" else pad_collate(feats, pad_token_id=0)
    grads, aux = tf.fwd_bwd(_state(), batch, loss=PPO)
    module = tf.models.from_hf_config(tiny_config("qwen2"), seed=0, device="cpu").module
    want_sum, want_grads = ppo_reference(module.to(torch.float64), feats, PPO)
    assert int(aux["num_tokens"]) == sum(x != -100 for f in feats for x in f["labels"])
    torch.testing.assert_close(aux["loss_sum"], want_sum, rtol=1e-10, atol=1e-10)
    assert grads.params.keys() == want_grads.keys()
    for name, grad in grads.params.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-10, atol=1e-10, msg=name)
