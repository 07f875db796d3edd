"""Router facts on the transformers backend (`twinkle_fn.backends.transformers.router`): the
router losses against `twinkle_fn.testing.router_reference` (transformers' and megatron-core's
formulas over a plain HF forward), the expert load against the HF routers' own top-k, and
routing replay; one process and two gloo ranks (ep2, tp2) in one spawn.

Tolerances. One process runs float64 (eager experts: transformers' grouped GEMM has no float64
kernel): gradients agree to 1e-12 relative (the same sums in another order; observed <= 1e-15);
the reported ``aux_loss`` / ``z_loss`` are float32 (1e-6; observed <= 5e-8). Two ranks run float32 against the float64
reference: 2e-5 relative on values and the routers' gradients (float32 rounding of sums over
32 tokens). Expert loads and routing records are integers: exact.
"""

from __future__ import annotations

import copy

import pytest
import torch

import twinkle_fn as tf
from twinkle_fn.data import pack, pad_collate
from twinkle_fn.distributed import rank
from twinkle_fn.testing import random_features, router_reference, tiny_config
from twinkle_fn.testing_dist import spawn

COEFS = {"aux_coef": 0.5, "z_coef": 0.1}  # large, so that a wrong term shows in the gradients
ROUTER = "model.layers.{}.mlp.gate.weight"


def _model(family="qwen3_moe", kind="hf", coefs=COEFS, dtype=torch.float64, recompute=False):
    config = tiny_config(family)
    config._experts_implementation = "eager"
    options = {"router_loss": {**coefs, "aux_kind": kind}}
    model = tf.models.from_hf_config(
        config, seed=0, options=options, device="cpu", activation_checkpointing=recompute
    )
    model.module.to(dtype)
    return model


def _batch(feats, layout):
    return pack(feats) if layout == "packed" else pad_collate(feats, pad_token_id=0)


def _run(model, batch):
    """fwd_bwd of a fresh state of `model`: the gradients divided by the token count, and aux."""
    state = tf.init(model, tf.optim.sgd(1.0))
    grads, aux = tf.fwd_bwd(state, batch)
    return {n: g / aux["num_tokens"] for n, g in grads.params.items()}, aux


def _reference(model, feats, kind, coefs=COEFS):
    return router_reference(copy.deepcopy(model.module), feats, aux_kind=kind, **coefs)


CASES = [
    ("qwen3_moe", "hf", COEFS, "padded"),
    ("qwen3_moe", "hf", COEFS, "recompute"),  # the gradient injected in the recomputation
    ("qwen3_moe", "hf", COEFS, "packed"),
    ("qwen3_moe", "megatron", COEFS, "padded"),
    ("qwen3_moe", "hf", {"aux_coef": 0.0, "z_coef": 0.0}, "padded"),  # off
    ("qwen2_moe", "hf", COEFS, "padded"),
    ("mixtral", "megatron", COEFS, "packed"),
    ("glm4_moe", "hf", COEFS, "padded"),
]


@pytest.mark.parametrize(("family", "kind", "coefs", "layout"), CASES)
def test_router_losses_and_expert_load_equal_the_reference(family, kind, coefs, layout):
    feats = random_features(6, seed=1)
    model = _model(family, kind, coefs, recompute=layout == "recompute")
    want = _reference(model, feats, kind, coefs)
    grads, aux = _run(model, _batch(feats, "packed" if layout == "packed" else "padded"))
    n = want["num_tokens"]
    assert int(aux["num_tokens"]) == n
    assert torch.equal(aux["expert_load"], want["load"])
    if coefs["aux_coef"]:
        torch.testing.assert_close(aux["aux_loss"], want["aux"].float(), rtol=1e-6, atol=0)
        torch.testing.assert_close(aux["z_loss"], want["z"].float(), rtol=1e-6, atol=0)
    else:
        assert "aux_loss" not in aux
    for name, g in want["grads"].items():
        torch.testing.assert_close(grads[name], g / n, rtol=1e-12, atol=1e-15, msg=name)


def test_accumulated_forwards_each_train_their_own_router_losses():
    """Two fwd_bwd calls accumulate ``N_1 (ce_1 / N_1 + aux_1) + N_2 (...)``: the sum of the
    two forwards' references (float64, 1e-12)."""
    feats = random_features(6, seed=1)
    model = _model()
    halves = [_reference(model, feats[:3], "hf"), _reference(model, feats[3:], "hf")]
    state = tf.init(model, tf.optim.sgd(1.0))
    grads, _ = tf.fwd_bwd(state, pack(feats[:3]))
    grads, aux = tf.fwd_bwd(state, pack(feats[3:]), accum=grads)
    assert int(grads.num_tokens) == sum(h["num_tokens"] for h in halves)
    torch.testing.assert_close(aux["aux_loss"], halves[1]["aux"].float(), rtol=1e-6, atol=0)
    for name, g in grads.params.items():
        want = halves[0]["grads"][name] + halves[1]["grads"][name]
        torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-15, msg=name)


def test_replay_reproduces_the_recorded_forward_and_forces_the_experts():
    """Recording weights: replay gives bit-identical log-probs, loss and records. After the
    routers move, routing differs without replay and equals the record with it (on every
    non-padding token)."""
    feats = random_features(6, seed=2)
    for layout in ("padded", "packed"):
        state = tf.init(_model(dtype=torch.float32), tf.optim.sgd(1.0))
        batch = _batch(feats, layout)
        out = tf.token_logps(state, batch, record_routing=True)
        record = out["routed_experts"]
        assert record.shape == (*batch["input_ids"].shape, 2, 2)
        replayed = {**batch, "routed_experts": record}
        again = tf.token_logps(state, replayed, record_routing=True)
        assert torch.equal(again["logps"], out["logps"])
        assert torch.equal(again["routed_experts"], record)
        _, plain = tf.fwd_bwd(state, batch)
        _, forced = tf.fwd_bwd(state, replayed)
        assert torch.equal(plain["loss_sum"], forced["loss_sum"])
        with torch.no_grad():  # an update that changes routing
            for layer in range(2):
                state.params[ROUTER.format(layer)].mul_(-3.0)
        real = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
        moved = tf.token_logps(state, batch, record_routing=True)["routed_experts"]
        assert not torch.equal(moved[real], record[real])
        forced = tf.token_logps(state, replayed, record_routing=True)["routed_experts"]
        assert torch.equal(forced[real], record[real])  # padding keeps the router's choice
        _, aux = tf.fwd_bwd(state, replayed)
        assert torch.equal(aux["expert_load"], plain["expert_load"])


def test_bad_router_options_and_records_are_refused_before_any_compute():
    state = tf.init(_model(dtype=torch.float32), tf.optim.sgd(1.0))
    batch = pad_collate(random_features(2, seed=3), pad_token_id=0)
    bad = torch.zeros(*batch["input_ids"].shape, 2, 3, dtype=torch.int64)
    with pytest.raises(
        ValueError, match=r"has shape \(2, \d+, 2, 3\).*\[B, T, moe_layers, top_k\]"
    ):
        tf.fwd_bwd(state, {**batch, "routed_experts": bad})
    with pytest.raises(ValueError, match=r"holds experts 4\.\.4, outside the model.s 0\.\.3"):
        tf.token_logps(state, {**batch, "routed_experts": bad[..., :2] + 4})
    with pytest.raises(ValueError, match="lists an expert twice for a token"):
        tf.fwd_bwd(state, {**batch, "routed_experts": bad[..., :2]})
    with pytest.raises(TypeError, match="must be an integer tensor"):
        tf.token_logps(state, {**batch, "routed_experts": bad[..., :2].float()})
    dense = tf.init(tf.models.from_hf_config(tiny_config("qwen2"), seed=0), tf.optim.sgd(1.0))
    with pytest.raises(ValueError, match=r"record_routing=True.*qwen2 model has no experts"):
        tf.token_logps(dense, batch, record_routing=True)
    with pytest.raises(ValueError, match="aux_kind must be one of"):
        _run(_model(kind="switch"), batch)


def test_routers_this_transformers_hides_cost_the_expert_load_only(monkeypatch):
    """transformers 5.17 scores GLM-4 MoE's and DeepSeek-V3's routing inside the MoE block (no
    router module records router_logits): training without router facts still works, with no
    expert load; a router loss or a routing record is refused naming the version."""
    from twinkle_fn.backends.transformers import router

    monkeypatch.setattr(router, "moe_routers", lambda module: [])
    batch = pad_collate(random_features(2, seed=3), pad_token_id=0)
    off = {"aux_coef": 0.0, "z_coef": 0.0}
    grads, aux = _run(_model(coefs=off, dtype=torch.float32), batch)
    assert "expert_load" not in aux and all(bool(g.isfinite().all()) for g in grads.values())
    with pytest.raises(ValueError, match=r"found 0 MoE routers.*upgrade transformers"):
        _run(_model(dtype=torch.float32), batch)
    state = tf.init(_model(coefs=off, dtype=torch.float32), tf.optim.sgd(1.0))
    with pytest.raises(ValueError, match=r"found 0 MoE routers"):
        tf.token_logps(state, batch, record_routing=True)


MESHES = {"dp2xep2": {"dp": 2, "ep": 2}, "tp2": {"tp": 2}}


def _two_ranks():
    """Per mesh: this rank's reported router facts and its routers' whole gradients (this
    rank's data slice)."""
    feats = random_features(8, seed=4)
    out = {}
    for name, sizes in MESHES.items():
        mesh = tf.Mesh(**sizes)
        model = _model(dtype=torch.float32)
        state = tf.init(model, tf.optim.sgd(1.0), mesh)
        mine = feats[mesh.get_slice(len(feats), rank())] if mesh.data_world_size > 1 else feats
        grads, aux = tf.fwd_bwd(state, pack(mine))
        routers = {}
        for layer in range(2):
            g = grads.params[ROUTER.format(layer)]
            routers[layer] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach()
        keep = ("expert_load", "aux_loss", "z_loss", "num_tokens")
        out[name] = {"aux": {k: aux[k] for k in keep}, "routers": routers}
    return out


@pytest.fixture(scope="module")
def two():
    return spawn(_two_ranks, 2, timeout_s=300)


@pytest.mark.parametrize("mesh", MESHES)
def test_two_ranks_equal_the_whole_batch_reference(two, mesh):
    """Statistics summed over the data ranks: every rank reports the whole batch's load and
    losses, and the routers' gradients (summed by FSDP over the data ranks) are the whole
    batch's."""
    feats = random_features(8, seed=4)
    want = _reference(_model(), feats, "hf")
    n = want["num_tokens"]
    for r in two:
        got = r[mesh]
        assert torch.equal(got["aux"]["expert_load"], want["load"])
        torch.testing.assert_close(got["aux"]["aux_loss"], want["aux"].float(), rtol=2e-5, atol=0)
        torch.testing.assert_close(got["aux"]["z_loss"], want["z"].float(), rtol=2e-5, atol=0)
    total = sum(int(r[mesh]["aux"]["num_tokens"]) for r in two)
    assert total == (n if MESHES[mesh].get("dp") else 2 * n)
    for layer in range(2):
        g = want["grads"][ROUTER.format(layer)].float() / n
        torch.testing.assert_close(two[0][mesh]["routers"][layer] / n, g, rtol=2e-5, atol=1e-7)
