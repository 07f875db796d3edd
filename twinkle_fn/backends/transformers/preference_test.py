"""DPO and SimPO on the transformers backend: ``tf.fwd_bwd`` (a pass without gradients, then
the linearised token loss) against the float64 HF model, padded and packed; fsdp2 on 2 ranks
(two pairs each) against one process (the mean over the step's four pairs); bad batches
refused before any compute."""

import pytest
import torch

import twinkle_fn as tf
from twinkle_fn.data import pack, pad_collate
from twinkle_fn.distributed import rank
from twinkle_fn.testing import preference_reference, random_features, tiny_config, with_rl_fields
from twinkle_fn.testing_dist import spawn

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


def _train(mesh_sizes):
    """Two DPO steps of 8 sequences (4 pairs; each rank its slice); losses and params."""
    mesh = tf.Mesh(**mesh_sizes)
    state = _state(mesh)
    losses = []
    for i in range(2):
        feats = with_rl_fields(random_features(8, seed=300 + i), seed=i)
        mine = feats[mesh.get_slice(len(feats), rank())] if mesh.world_size > 1 else feats
        grads, _ = tf.fwd_bwd(state, pack(mine), loss=LOSSES["dpo"])
        state, info = tf.step(state, grads)
        losses.append((float(info["loss"]), int(info["num_tokens"])))
    return losses, tf.unshard(state)


def test_dpo_on_fsdp2_matches_one_process():
    """float64: losses to 1e-11, parameters after 2 AdamW steps to 1e-9 (as `fsdp_test`)."""
    ref_losses, ref_params = _train({})
    assert [n for _, n in ref_losses] == [4, 4]
    for losses, params in spawn(_train, 2, {"fsdp": 2}):
        for (loss, n), (ref, ref_n) in zip(losses, ref_losses, strict=True):
            assert loss == pytest.approx(ref, rel=1e-11) and n == ref_n
        for name, p in params.items():
            torch.testing.assert_close(p, ref_params[name], rtol=1e-9, atol=1e-11, msg=name)
