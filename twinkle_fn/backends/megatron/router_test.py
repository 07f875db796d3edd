"""Router facts on the megatron backend (`twinkle_fn.backends.megatron.router`): the router
losses against `twinkle_fn.testing.router_reference` (transformers' and megatron-core's
formulas over a float64 HF forward: the transformers backend's reference too, so the two
backends agree), the expert load against the HF routers' own top-k, and routing replay; one
process, and two gloo ranks (ep2, tp2 with sequence parallelism) in one spawn.

Tolerances (float32: megatron's float32 model against the float64 reference). Values 2e-5
relative, the routers' gradients (divided by the token count) 2e-5 relative and 1e-7 absolute:
float32 rounding of sums over a few dozen tokens, in another order on two ranks (observed
<= 5e-7 on one process). Expert loads and routing
records are integers: exact (no float32 near-tie in these batches).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import twinkle_fn as tf
from twinkle_fn.backends.megatron import parallel
from twinkle_fn.data import pack, pad_collate
from twinkle_fn.distributed import rank
from twinkle_fn.testing import random_features, router_reference, tiny_config
from twinkle_fn.testing_dist import spawn

COEFS = {"aux_coef": 0.5, "z_coef": 0.1}  # large, so that a wrong term shows in the gradients
ROUTER = "decoder.layers.{}.mlp.router.weight"
HF_ROUTER = "model.layers.{}.mlp.gate.weight"
RTOL, ATOL = 2e-5, 1e-7


def _config():
    config = tiny_config("qwen3_moe")
    config._experts_implementation = "eager"  # the float64 reference: no grouped GEMM
    return config


def _model(kind="hf", coefs=COEFS, recompute=False, micro_batches=1):
    options = {
        "router_loss": {**coefs, "aux_kind": kind},
        "overlap_grad_reduce": False,
        "num_micro_batches": micro_batches,
    }
    return tf.models.from_hf_config(
        _config(),
        seed=0,
        backend="megatron",
        options=options,
        activation_checkpointing=recompute,
    )


def _reference(feats, kind="hf", coefs=COEFS):
    torch.manual_seed(0)
    module = AutoModelForCausalLM.from_config(_config()).to(torch.float64)
    return router_reference(module, feats, aux_kind=kind, **coefs)


def _batch(feats, layout):
    return pack(feats) if layout == "packed" else pad_collate(feats, pad_token_id=0)


def _facts(state, batch):
    """fwd_bwd's router facts and this rank's routers' local gradient sums (no reduction:
    ``overlap_grad_reduce=False``)."""
    grads, aux = tf.fwd_bwd(state, batch)
    keep = ("expert_load", "aux_loss", "z_loss", "num_tokens")
    routers = [grads.params[ROUTER.format(i)].detach().clone() for i in range(2)]
    return {k: aux[k] for k in keep if k in aux}, routers


def _replay(state, batch):
    """The record of `batch`, then after the routers move: the routing without replay and
    with it."""
    record = tf.token_logps(state, batch, record_routing=True)["routed_experts"]
    again = tf.token_logps(state, {**batch, "routed_experts": record}, record_routing=True)
    with torch.no_grad():  # an update that changes routing
        for i in range(2):
            state.params[ROUTER.format(i)].mul_(-3.0)
    moved = tf.token_logps(state, batch, record_routing=True)["routed_experts"]
    replayed = {**batch, "routed_experts": record}
    forced = tf.token_logps(state, replayed, record_routing=True)["routed_experts"]
    _, aux = tf.fwd_bwd(state, replayed)
    return dict(record=record, again=again, moved=moved, forced=forced, load=aux["expert_load"])


CASES = {
    "hf-packed": ("hf", COEFS, "packed"),
    "hf-padded": ("hf", COEFS, "padded"),
    "megatron-padded": ("megatron", COEFS, "padded"),
    "off-packed": ("hf", {"aux_coef": 0.0, "z_coef": 0.0}, "packed"),
    # megatron's full recompute: the gradient injected in the recomputed forward
    "hf-recompute": ("hf", COEFS, "recompute"),
}


@pytest.fixture(scope="module")
def one(megatron_world):
    feats = random_features(6, seed=1)
    runs = {}
    for name, (kind, coefs, layout) in CASES.items():
        model = _model(kind, coefs, recompute=layout == "recompute")
        batch = _batch(feats, "padded" if layout == "padded" else "packed")
        runs[name] = _facts(tf.init(model, tf.optim.sgd(1.0)), batch)
    two_mb = tf.init(_model(micro_batches=2), tf.optim.sgd(1.0))
    runs["two-micro-batches"] = _facts(two_mb, pack(feats))
    replays = {
        layout: _replay(tf.init(_model(), tf.optim.sgd(1.0)), _batch(feats, layout))
        for layout in ("padded", "packed")
    }
    state = tf.init(_model(), tf.optim.sgd(1.0))
    record8 = tf.token_logps(state, pack(random_features(8, seed=4)), record_routing=True)
    return dict(runs=runs, replays=replays, feats=feats, record8=record8["routed_experts"])


def _check(aux, routers, want, coefs):
    n = want["num_tokens"]
    assert int(aux["num_tokens"]) == n
    assert torch.equal(aux["expert_load"].cpu(), want["load"])
    if coefs["aux_coef"]:
        torch.testing.assert_close(aux["aux_loss"], want["aux"].float(), rtol=RTOL, atol=0)
        torch.testing.assert_close(aux["z_loss"], want["z"].float(), rtol=RTOL, atol=0)
    else:
        assert "aux_loss" not in aux
    for i, g in enumerate(routers):
        ref = want["grads"][HF_ROUTER.format(i)].float() / n
        torch.testing.assert_close(g.cpu() / n, ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("case", CASES)
def test_router_losses_and_expert_load_equal_the_reference(one, case):
    kind, coefs, _ = CASES[case]
    _check(*one["runs"][case], _reference(one["feats"], kind, coefs), coefs)


def test_each_micro_batch_trains_its_own_router_losses(one):
    """Two micro-batches of three samples: the sum of the halves' references (their router
    losses weighted by their token counts), the reported losses their token-weighted mean."""
    feats = one["feats"]
    halves = [_reference(feats[:3]), _reference(feats[3:])]
    aux, routers = one["runs"]["two-micro-batches"]
    n = sum(h["num_tokens"] for h in halves)
    assert int(aux["num_tokens"]) == n
    assert torch.equal(aux["expert_load"].cpu(), halves[0]["load"] + halves[1]["load"])
    mean = sum(h["num_tokens"] * h["aux"] for h in halves) / n
    torch.testing.assert_close(aux["aux_loss"], mean.float(), rtol=RTOL, atol=0)
    for i, g in enumerate(routers):
        ref = sum(h["grads"][HF_ROUTER.format(i)] for h in halves).float() / n
        torch.testing.assert_close(g.cpu() / n, ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_replay_reproduces_the_recorded_forward_and_forces_the_experts(one, layout):
    r = one["replays"][layout]
    batch = _batch(one["feats"], layout)
    assert r["record"].shape == (*batch["input_ids"].shape, 2, 2)
    assert torch.equal(r["again"]["routed_experts"], r["record"])
    real = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
    assert not torch.equal(r["moved"][real], r["record"][real])
    assert torch.equal(r["forced"][real], r["record"][real])  # padding: the router's choice
    assert torch.equal(r["load"].cpu(), _reference(one["feats"])["load"])


def test_megatrons_own_router_loss_options_are_refused(megatron_world):
    model = tf.models.from_hf_config(
        _config(), seed=0, backend="megatron", options={"moe_aux_loss_coeff": 0.01}
    )
    with pytest.raises(ValueError, match="moe_aux_loss_coeff would turn on megatron-core's own"):
        tf.init(model, tf.optim.sgd(1.0))


MESHES = {"ep2": {"dp": 2, "ep": 2}, "tp2-sp": {"tp": 2, "sequence_parallel": True}}


def _two_ranks():
    feats = random_features(8, seed=4)
    out = {}
    for name, sizes in MESHES.items():
        mesh = tf.Mesh(**sizes)
        mine = feats[mesh.get_slice(len(feats), rank())] if mesh.data_world_size > 1 else feats
        state = tf.init(_model(), tf.optim.sgd(1.0), mesh)
        aux, routers = _facts(state, pack(mine))
        out[name] = dict(aux=aux, routers=routers, replay=_replay(state, pack(mine)))
        parallel.destroy()
    return out


@pytest.fixture(scope="module")
def two(one):
    return spawn(_two_ranks, 2, timeout_s=300)


@pytest.mark.parametrize("mesh", MESHES)
def test_two_ranks_equal_the_whole_batch_reference(one, two, mesh):
    """Each rank reports the whole batch's load and losses; the routers' gradients summed over
    the ranks holding other tokens (the data ranks; the sequence halves under tp2 with sequence
    parallelism) are the whole batch's; on each rank replay forces the recorded experts."""
    feats = random_features(8, seed=4)
    want = _reference(feats)
    routers = [sum(r[mesh]["routers"][i] for r in two) for i in range(2)]
    for r in two:
        aux = dict(r[mesh]["aux"])
        aux["num_tokens"] = torch.tensor(want["num_tokens"])  # this rank's count: checked below
        _check(aux, routers, want, COEFS)
        rep = r[mesh]["replay"]
        assert torch.equal(rep["forced"], rep["record"])
        assert not torch.equal(rep["moved"], rep["record"])
    counts = [int(r[mesh]["aux"]["num_tokens"]) for r in two]
    assert sum(counts) == want["num_tokens"] * (1 if "dp" in MESHES[mesh] else 2)
    if "dp" in MESHES[mesh]:  # each data rank records its own rows: the whole batch's record
        whole = one["record8"]
        for i, r in enumerate(two):
            mine = feats[tf.Mesh(**MESHES[mesh]).get_slice(len(feats), i)]
            assert r[mesh]["replay"]["record"].shape[1] == sum(len(f["input_ids"]) for f in mine)
        assert torch.equal(torch.cat([r[mesh]["replay"]["record"] for r in two], 1), whole)
