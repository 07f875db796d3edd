"""A critic on the transformers backend: per-token values and the clipped value loss against the
float64 HF model (value and gradient, padded and packed); fsdp2, and tp2 with sequence
parallelism, on 2 ranks against one process (the tolerances of `fsdp_test`); a save/load round
trip through `tf.checkpoint`; and the refusals that come before any compute."""

import pytest
import torch

import twinkle_fn as tf
from twinkle_fn import backends
from twinkle_fn.data import pack, pad_collate
from twinkle_fn.distributed import rank
from twinkle_fn.testing import (
    random_features,
    tiny_config,
    value_reference,
    with_advantages,
    with_value_fields,
)
from twinkle_fn.testing_dist import spawn

LOSS = tf.losses.value_loss(0.2)


def _model(seed=0):
    model = tf.models.from_hf_config(tiny_config("qwen2"), seed=seed, device="cpu", head="value")
    model.module.to(torch.float64)
    return model


def _state(mesh=None, seed=0):
    return tf.init(_model(seed), tf.optim.adamw(1e-2), mesh)


def _batch(feats, layout):
    return pack(feats) if layout == "packed" else pad_collate(feats, pad_token_id=0)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_value_loss_equals_its_float64_reference_in_value_and_gradient(layout):
    """float64 throughout: the same sums in another order (1e-10)."""
    feats = with_value_fields(random_features(5, seed=7), seed=7)
    grads, aux = tf.fwd_bwd(_state(), _batch(feats, layout), loss=LOSS)
    want_sum, want_grads = value_reference(_model().module, feats, LOSS.clip)
    assert int(aux["num_tokens"]) == sum(x != -100 for f in feats for x in f["labels"])
    torch.testing.assert_close(aux["loss_sum"], want_sum, rtol=1e-10, atol=1e-10)
    assert grads.params.keys() == want_grads.keys()
    assert bool(grads.params["score.weight"].abs().sum() > 0)  # the head trains too
    for name, grad in grads.params.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-10, atol=1e-10, msg=name)


def test_token_values_are_the_score_heads_outputs_at_supervised_tokens():
    """float64: padded and packed layouts give the plain forward's values (1e-12), 0 where the
    label is -100."""
    feats = random_features(4, seed=3)
    state = _state()
    padded = pad_collate(feats, pad_token_id=0)
    with torch.no_grad():
        want = state.model.module(
            input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]
        ).logits[..., 0]  # [B, T]
    want = torch.where(padded["labels"] != -100, want, 0.0)
    out = tf.token_values(state, padded)
    assert out["values"].dtype == torch.float64 and not out["values"].requires_grad
    torch.testing.assert_close(out["values"], want, rtol=1e-12, atol=1e-12)
    assert int(out["num_tokens"]) == int((padded["labels"] != -100).sum())
    packed = tf.token_values(state, pack(feats))["values"]  # [1, T]
    torch.testing.assert_close(packed[packed != 0], want[want != 0], rtol=1e-12, atol=1e-12)


def _train(mesh_sizes):
    """Two steps of 8 samples (each rank its slice); losses and final params."""
    mesh = tf.Mesh(**mesh_sizes)
    state = _state(mesh)
    losses = []
    for i in range(2):
        feats = with_value_fields(random_features(8, seed=300 + i), seed=i)
        mine = feats[mesh.get_slice(len(feats), rank())] if mesh.world_size > 1 else feats
        grads, _ = tf.fwd_bwd(state, pack(mine), loss=LOSS)
        state, info = tf.step(state, grads)
        losses.append(float(info["loss"]))
    return losses, tf.unshard(state)


MESHES = ({"fsdp": 2}, {"tp": 2, "sequence_parallel": True})


def _train_meshes():
    """`_train` on each of `MESHES`, one after the other in the same two processes."""
    return [_train(sizes) for sizes in MESHES]


def test_the_critic_on_fsdp2_and_tp2_with_sequence_parallelism_matches_one_process():
    """float64: losses to 1e-11, parameters after 2 AdamW steps to 1e-9 (as `fsdp_test`). Under
    tp the score head is replicated and gathers the whole sequence, as the lm_head does."""
    ref_losses, ref_params = _train({})
    assert "score.weight" in ref_params
    for per_mesh in spawn(_train_meshes, 2):
        for sizes, (losses, params) in zip(MESHES, per_mesh, strict=True):
            assert losses == pytest.approx(ref_losses, rel=1e-11), sizes
            for n, p in params.items():
                torch.testing.assert_close(p, ref_params[n], rtol=1e-9, atol=1e-11, msg=n)


def test_save_load_of_a_critic_round_trips_the_head(tmp_path):
    """Trained, saved, loaded into a critic of other weights: every parameter (the score head
    included) and the next step are bit-identical; the directory loads as a value model."""
    batch = pack(with_value_fields(random_features(4, seed=5), seed=5))
    state = _state()
    state, _ = tf.step(state, tf.fwd_bwd(state, batch, loss=LOSS)[0])
    tf.checkpoint.save(state, tmp_path / "critic")
    loaded = tf.checkpoint.load(_state(seed=1), tmp_path / "critic")
    for name, p in state.params.items():
        assert torch.equal(loaded.params[name], p), name
    hf = tf.models.from_pretrained(tmp_path / "critic", device="cpu", head="value").module
    assert torch.equal(hf.score.weight, state.params["score.weight"].float())
    after, _ = tf.step(state, tf.fwd_bwd(state, batch, loss=LOSS)[0])
    again, _ = tf.step(loaded, tf.fwd_bwd(loaded, batch, loss=LOSS)[0])
    for name, p in after.params.items():
        assert torch.equal(again.params[name], p), name


def test_what_a_head_cannot_feed_is_refused_before_any_compute(monkeypatch):
    """The backend is never reached and `accum` is not donated."""
    critic = _state()
    actor = tf.init(
        tf.models.from_hf_config(tiny_config("qwen2"), seed=0, device="cpu"), tf.optim.adamw(1e-2)
    )
    feats = with_value_fields(with_advantages(random_features(3, seed=4)), seed=4)
    accum, _ = tf.fwd_bwd(critic, pack(feats), loss=LOSS)

    def no_compute(*args, **kwargs):
        raise AssertionError("the backend computed")

    for hook in ("fwd_bwd", "token_logps", "token_values", "loss_of"):
        monkeypatch.setattr(type(backends.get("transformers")), hook, no_compute)
    for state, loss, match in (
        (critic, None, "value head.*the default cross entropy cannot train it"),
        (critic, tf.losses.policy_gradient(), r"value head.*PolicyGradient\(.*cannot train it"),
        (actor, LOSS, "ValueLoss.*needs 'values'.*no value head.*head='value'"),
    ):
        with pytest.raises(ValueError, match=match):
            tf.fwd_bwd(state, pack(feats), accum if state is critic else None, loss=loss)
    accum.check_alive()
    with pytest.raises(ValueError, match=r"value model \(head='value'\).*tf.token_values"):
        tf.token_logps(critic, pack(feats))
    with pytest.raises(ValueError, match="default cross entropy cannot train it"):
        tf.evaluate(critic, pack(feats))
    with pytest.raises(ValueError, match=r"tf.token_values needs a value model.*head='value'"):
        tf.token_values(actor, pack(feats))
    with pytest.raises(ValueError, match=r"add_lora on a value model would freeze its .*score"):
        tf.lora.add_lora(_model(), {"r": 4, "target_modules": "all-linear"})
