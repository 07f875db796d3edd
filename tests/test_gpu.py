"""The single-process path on one CUDA GPU: fp32 parity with the CPU, and bf16 training."""

import json

import pytest
import torch

import twinkle_fn as tf
from twinkle.cli import main
from twinkle_fn.data import pack
from twinkle_fn.testing import random_features, tiny_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU)"),
]


def _state(device, precision="fp32"):
    model = tf.models.from_hf_config(tiny_config(), seed=0, device=device, precision=precision)
    tx = tf.optim.chain(tf.optim.clip_by_global_norm(1.0), tf.optim.adamw(1e-2))
    return tf.init(model, tx)


def test_fp32_cuda_step_matches_cpu(monkeypatch):
    """Same weights and batch: loss, grads and updated params agree to float32 rounding.

    TF32 is off so both devices do true float32 matmuls; differences come from reduction order
    only (rtol 1e-4 on values of order 1, atol 1e-5 for small gradients).
    """
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    batch = pack(random_features(6))
    results = {}
    for device in ("cpu", "cuda"):
        state = _state(device)
        grads, _ = tf.fwd_bwd(state, batch)
        g = {n: t.to("cpu", copy=True) for n, t in grads.params.items()}
        state, info = tf.step(state, grads)
        results[device] = (float(info["loss"]), g, {n: p.cpu() for n, p in state.params.items()})
    (l_cpu, g_cpu, p_cpu), (l_gpu, g_gpu, p_gpu) = results["cpu"], results["cuda"]
    assert l_gpu == pytest.approx(l_cpu, rel=1e-5)
    for name in g_cpu:
        torch.testing.assert_close(g_gpu[name], g_cpu[name], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(p_gpu[name], p_cpu[name], rtol=1e-4, atol=1e-5)


def test_bf16_training_on_cuda_reduces_heldout_loss(tmp_path):
    args = ["train", "--precision", "bf16", "--steps", "150", "--no-progress"]
    assert main([*args, "--output-dir", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["heldout_loss_after"] < 0.5 * summary["heldout_loss_before"]


def test_bf16_params_stay_fp32_master_weights():
    state = _state("cuda", precision="bf16")
    grads, _ = tf.fwd_bwd(state, pack(random_features(4)))
    assert all(g.dtype == torch.float32 for g in grads.params.values())
    state, info = tf.step(state, grads)
    assert torch.isfinite(info["loss"]) and all(
        p.dtype == torch.float32 and p.is_cuda for p in state.params.values()
    )
