"""`megatron_optimizer` refuses what it cannot run; its training behaviour (lr schedule, fp32
master weights, fp16 overflow skips) is checked end to end in `megatron_test.py`. The one-GPU
full fine-tuning option (`twinkle_fn.optim.adamw_bf16`) trains like it."""

import pytest
import torch

import twinkle_fn as tf
from twinkle_fn.backends.megatron import parallel
from twinkle_fn.backends.megatron.optimizer import megatron_optimizer
from twinkle_fn.data import pack
from twinkle_fn.optim import adamw, adamw_bf16, chain, clip_by_global_norm
from twinkle_fn.testing import random_features, tiny_config


def test_megatron_optimizer_needs_a_megatron_model():
    with pytest.raises(TypeError, match="prepared by the megatron backend"):
        megatron_optimizer(1e-3).init({"w": torch.zeros(2)})
    with pytest.raises(ValueError, match="b1"):
        megatron_optimizer(1e-3, b1=1.0)


# The megatron side of `twinkle_fn.optim.adamw_bf16_test`'s parity: 50 steps of the tiny qwen2
# in bf16, cycling over 4 batches. Measured max |loss - megatron_optimizer's (float32 main
# params and moments)|: adamw_bf16 0.0038, adamw on the bf16 params (round to nearest) 0.052.
PARITY_STEPS, LR = 50, 1e-3
SR_MAX_LOSS_DIFF, RN_FACTOR = 0.01, 5


def _losses(tx):
    model = tf.models.from_hf_config(
        tiny_config("qwen2"), seed=0, precision="bf16", backend="megatron"
    )
    state = tf.init(model, tx)
    data = [pack(random_features(8, seed=s)) for s in range(4)]
    losses = []
    for i in range(PARITY_STEPS):
        grads, _ = tf.fwd_bwd(state, data[i % len(data)])
        state, info = tf.step(state, grads)
        losses.append(float(info["loss"]))
    dtypes = {p.dtype for p in state.model.placement.module.parameters()}
    parallel.destroy()
    return torch.tensor(losses), dtypes


def test_adamw_bf16_on_the_bf16_params_follows_the_distributed_optimizer(megatron_world):
    """adamw_bf16 runs through the backend's generic path on the model's own bf16 parameters
    (10 bytes a parameter with the float32 grad buffer, against the distributed optimizer's 18)."""
    ref, _ = _losses(megatron_optimizer(LR, weight_decay=0.01, clip_grad=1.0))
    sr, dtypes = _losses(chain(clip_by_global_norm(1.0), adamw_bf16(LR, weight_decay=0.01)))
    rn, _ = _losses(chain(clip_by_global_norm(1.0), adamw(LR, weight_decay=0.01)))
    assert dtypes == {torch.bfloat16}
    sr_diff, rn_diff = (float((x - ref).abs().max()) for x in (sr, rn))
    assert sr_diff < SR_MAX_LOSS_DIFF
    assert rn_diff > RN_FACTOR * sr_diff
