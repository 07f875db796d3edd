"""Upstream's routing-replay flow through the class API (``forward_only(...,
router_replay_action=RECORD)`` returns ``routed_experts``; the samples carry their rows into
``forward_backward(..., router_replay_action=REPLAY_FORWARD)``), on both backends, against the
core's replay of the same record."""

from __future__ import annotations

import enum

import pytest
import torch

import twinkle_fn as tf
from twinkle.device_mesh import DeviceMesh
from twinkle.model import MegatronModel, TransformersModel
from twinkle.processor import unpack
from twinkle_fn.data import pad_collate
from twinkle_fn.testing import random_features, tiny_config


class RouterReplayAction(enum.Enum):
    """Upstream's enum (``twinkle.model.transformers.moe.router_replay``), by value."""

    RECORD = "record"
    REPLAY_FORWARD = "replay_forward"


def _model(backend):
    if backend == "megatron":
        mesh = DeviceMesh.from_sizes(world_size=1)
        m = MegatronModel(
            config=tiny_config("qwen3_moe"), device_mesh=mesh, mixed_precision="no", seed=0
        )
        m.set_optimizer("default", lr=1e-2)
        return m
    m = TransformersModel(
        config=tiny_config("qwen3_moe"), mixed_precision="no", seed=0, enable_router_replay=True
    )
    m.set_optimizer("AdamW", lr=1e-2)
    return m


@pytest.mark.parametrize("backend", ["transformers", "megatron"])
def test_recorded_routing_replays_through_the_class_api(backend, no_leak):
    feats = random_features(4, seed=11)
    m = _model(backend)
    out = m.forward_only(inputs=feats, router_replay_action=RouterReplayAction.RECORD)
    record = out["routed_experts"]  # [n_seq, max_len, moe_layers, top_k]
    assert record.shape == (4, max(len(f["input_ids"]) for f in feats), 2, 2)
    replayed = [dict(f, routed_experts=record[i]) for i, f in enumerate(feats)]
    same = m.forward_only(inputs=replayed, router_replay_action="replay_forward")
    assert torch.equal(same["logps"], out["logps"])
    state = m._ensure_state(m._resolve(None))
    with torch.no_grad():  # move the routers: routing changes
        for name, p in state.params.items():
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                p.mul_(-3.0)
    moved = m.forward_only(inputs=feats, router_replay_action="record")["routed_experts"]
    assert not torch.equal(moved, record)
    # the core routed by the same record (padded rows) gives the class API's log-probs
    batch = pad_collate(feats, pad_token_id=0)
    core = tf.token_logps(state, {**batch, "routed_experts": record})["logps"]
    forced = m.forward_only(inputs=replayed, router_replay_action="replay_forward")
    torch.testing.assert_close(forced["logps"], unpack(core, batch), rtol=0, atol=1e-6)
    assert not torch.allclose(forced["logps"], m.forward_only(inputs=feats)["logps"])
    trained = m.forward_backward(
        inputs=replayed, router_replay_action=RouterReplayAction.REPLAY_FORWARD
    )
    assert trained["loss"] == pytest.approx(forced["loss"], rel=1e-5)
    with pytest.raises(ValueError, match="RECORD belongs to forward_only"):
        m.forward_backward(inputs=feats, router_replay_action="record")
    with pytest.raises(ValueError, match="router_replay_action must be one of"):
        m.forward_only(inputs=feats, router_replay_action="replay_backward_twice")
