"""A dropped MoE model is freed: its token dispatchers keep no autograd history of the last
forward (which held the whole model alive through megatron's DDP gradient hooks)."""

import gc
import weakref

import torch

import twinkle_fn as tf
from twinkle_fn.backends.megatron.backend import megatron_optimizer
from twinkle_fn.backends.megatron.dispatch_state import drop_dispatch_history
from twinkle_fn.data import pack
from twinkle_fn.testing import random_features, tiny_config


def _history(chunks) -> list[str]:
    """Names of dispatcher attributes that hold a tensor with autograd history."""
    return [
        name
        for chunk in chunks
        for module in chunk.modules()
        if hasattr(module, "token_dispatcher")
        for name, value in vars(module.token_dispatcher).items()
        if isinstance(value, torch.Tensor) and value.grad_fn is not None
    ]


def test_a_dropped_moe_model_is_freed(megatron_world):
    model = tf.models.from_hf_config(tiny_config("qwen3_moe"), seed=0, backend="megatron")
    state = tf.init(model, megatron_optimizer(1e-2))
    grads, _ = tf.fwd_bwd(state, pack(random_features(4, seed=1)))
    state, _ = tf.step(state, grads)
    chunks = state.model.placement.chunks
    assert _history(chunks) == []
    ddp = weakref.ref(chunks[0])
    del model, state, grads, chunks
    gc.collect()
    assert ddp() is None


def test_drop_dispatch_history_drops_what_a_forward_left(megatron_world):
    model = tf.models.from_hf_config(tiny_config("qwen3_moe"), seed=0, backend="megatron")
    state = tf.init(model, megatron_optimizer(1e-2))
    chunk = state.model.placement.chunks[0]
    batch = pack(random_features(2, seed=2))
    # The forward megatron runs, without the schedule that drops the history after it.
    out = chunk(batch["input_ids"], batch["position_ids"], None)
    held = _history([chunk])
    assert held, "a dispatcher should hold its forward's routing probabilities"
    assert drop_dispatch_history([chunk]) == len(held)
    assert _history([chunk]) == []
    del out
