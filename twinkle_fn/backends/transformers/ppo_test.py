"""The PPO / GRPO loss on the transformers backend: one process against the float64 HF model,
and a 2-rank fsdp2 mesh against one process (the tolerances of `fsdp_test`)."""

import pytest
import torch

import twinkle_fn as tf
from twinkle_fn.data import pack, pad_collate
from twinkle_fn.distributed import rank
from twinkle_fn.testing import ppo_reference, random_features, tiny_config, with_rl_fields
from twinkle_fn.testing_dist import spawn

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


def _train(mesh_sizes):
    """Two steps of 8 samples (each rank its slice); losses and final params."""
    mesh = tf.Mesh(**mesh_sizes)
    state = _state(mesh)
    losses = []
    for i in range(2):
        feats = with_rl_fields(random_features(8, seed=200 + i), seed=i)
        mine = feats[mesh.get_slice(len(feats), rank())] if mesh.world_size > 1 else feats
        grads, _ = tf.fwd_bwd(state, pack(mine), loss=PPO)
        state, info = tf.step(state, grads)
        losses.append(float(info["loss"]))
    return losses, tf.unshard(state)


def test_the_ppo_loss_on_fsdp2_matches_one_process():
    """float64: losses to 1e-11, parameters after 2 AdamW steps to 1e-9 (as `fsdp_test`)."""
    ref_losses, ref_params = _train({})
    for losses, params in spawn(_train, 2, {"fsdp": 2}):
        assert losses == pytest.approx(ref_losses, rel=1e-11)
        for n, p in params.items():
            torch.testing.assert_close(p, ref_params[n], rtol=1e-9, atol=1e-11, msg=n)
