import pytest
import torch

import twinkle_fn as tf
from twinkle_fn.backends.transformers.loss_scale import init_loss_scale, next_loss_scale
from twinkle_fn.data import pack
from twinkle_fn.testing import random_features, tiny_config


def test_overflow_halves_and_resets_good_steps_growth_doubles():
    ls = init_loss_scale(8.0)
    ls = next_loss_scale(ls, finite=True, growth_interval=2)
    assert float(ls.scale) == 8.0 and int(ls.good_steps) == 1
    ls = next_loss_scale(ls, finite=True, growth_interval=2)
    assert float(ls.scale) == 16.0 and int(ls.good_steps) == 0
    ls = next_loss_scale(next_loss_scale(ls, True, 2), finite=False, growth_interval=2)
    assert float(ls.scale) == 8.0 and int(ls.good_steps) == 0


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), "65536"])
def test_bad_initial_scale_is_named(bad):
    with pytest.raises(ValueError, match="loss scale"):
        init_loss_scale(bad)


def _fp16_state(loss_scale=2.0**8, precision="fp16"):
    model = tf.models.from_hf_config(tiny_config(), seed=0, device="cpu", precision=precision)
    return tf.init(model, tf.optim.adamw(1e-2), loss_scale=loss_scale)


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    state = _fp16_state(loss_scale=2.0**127)  # the scaled fp32 loss sum overflows to inf
    before = {n: p.detach().clone() for n, p in state.params.items()}
    grads, _ = tf.fwd_bwd(state, pack(random_features(4)))
    state, info = tf.step(state, grads)
    assert info["skipped"] and info["loss_scale"] == 2.0**127
    assert float(state.loss_scale.scale) == 2.0**126 and int(state.step) == 0
    assert all(torch.equal(p, before[n]) for n, p in state.params.items())


def test_fp16_training_tracks_fp32_and_learns():
    """fp16 matmuls (10 mantissa bits) with loss scaling follow the fp32 run closely (no step
    overflows at scale 2**8 on this model, so the runs stay in lockstep)."""
    batch = pack(random_features(8, seed=3))
    losses = {}
    for precision in ("fp32", "fp16"):
        state = _fp16_state(precision=precision)
        assert (state.loss_scale is not None) == (precision == "fp16")
        run = []
        for _ in range(6):
            state, info = tf.step(state, tf.fwd_bwd(state, batch)[0])
            assert not info.get("skipped", False)
            run.append(float(info["loss"]))
        losses[precision] = run
    assert losses["fp16"] == pytest.approx(losses["fp32"], rel=2e-2)
    assert losses["fp16"][-1] < 0.8 * losses["fp16"][0]


def test_checkpoint_keeps_the_loss_scale(tmp_path):
    state = _fp16_state(loss_scale=1024.0)
    state, _ = tf.step(state, tf.fwd_bwd(state, pack(random_features(2)))[0])
    tf.checkpoint.save(state, tmp_path / "c")
    loaded = tf.checkpoint.load(_fp16_state(), tmp_path / "c")
    assert float(loaded.loss_scale.scale) == 1024.0 and int(loaded.loss_scale.good_steps) == 1


def test_grad_norm_divides_the_loss_scale_out():
    """tf.grad_norm of loss-scaled fp16 gradients is the norm tf.step reports for them (the
    scale and the token count divided out), and the fp32 gradients' up to fp16 rounding."""
    batch = pack(random_features(4, seed=5))
    norms = {}
    for precision in ("fp32", "fp16"):
        state = _fp16_state(loss_scale=2.0**10, precision=precision)
        grads, _ = tf.fwd_bwd(state, batch)
        norms[precision] = float(tf.grad_norm(state, grads))
        _, info = tf.step(state, grads)
        assert norms[precision] == pytest.approx(float(info["grad_norm"]), rel=1e-6)
    assert norms["fp16"] == pytest.approx(norms["fp32"], rel=1e-3)
