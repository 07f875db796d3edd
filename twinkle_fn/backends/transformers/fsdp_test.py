"""The fsdp backend on real gloo ranks: parity with one process, and the specs match the shards."""

import dataclasses

import pytest
import torch

import twinkle_fn as tf
from twinkle_fn.backends.transformers.fsdp import (
    LATENT_KV,
    SharedRotaryKey,
    _check_sequence_parallel,
    _shared_key_styles,
)
from twinkle_fn.backends.transformers.plans import local_specs, param_specs
from twinkle_fn.data import pack, split_features
from twinkle_fn.distributed import rank
from twinkle_fn.models import family, registered
from twinkle_fn.testing import random_features, tiny_config, with_advantages
from twinkle_fn.testing_dist import spawn

STEPS = 3
MESHES = {
    "dp2": {"dp": 2},
    "fsdp2": {"fsdp": 2},
    "tp2": {"tp": 2},
    "dp2xtp2": {"dp": 2, "tp": 2},
    "fsdp2xtp2": {"fsdp": 2, "tp": 2},
    "hsdp:dp2xfsdp2": {"dp": 2, "fsdp": 2},
    "tp2+sp": {"tp": 2, "sequence_parallel": True},
}


def _state(mesh, family="qwen2", dtype=torch.float64, precision="fp32"):
    model = tf.models.from_hf_config(tiny_config(family), seed=0, device="cpu", precision=precision)
    model.module.to(dtype)
    tx = tf.optim.chain(tf.optim.clip_by_global_norm(1.0), tf.optim.adamw(1e-2))
    return tf.init(model, tx, mesh)


def _train(mesh_sizes, family="qwen2", dtype=torch.float64, precision="fp32", micro=1, loss=None):
    """Train STEPS steps on this rank's slice of each global batch (in `micro` accumulated
    micro-batches; a `loss` other than the default gets per-token advantages); losses and final
    params."""
    mesh = tf.Mesh(**mesh_sizes)
    state = _state(mesh, family, dtype, precision)
    losses = []
    for i in range(STEPS):
        feats = random_features(8, seed=100 + i)
        if loss is not None:
            feats = with_advantages(feats, seed=i)
        mine = feats[mesh.get_slice(len(feats), rank())] if mesh.world_size > 1 else feats
        grads = None
        for part in split_features(mine, micro):
            grads, _ = tf.fwd_bwd(state, pack(part), accum=grads, loss=loss)
        state, info = tf.step(state, grads)
        losses.append(float(info["loss"]))
    return losses, tf.unshard(state)


@pytest.fixture(scope="module")
def reference():
    return _train({})


@pytest.mark.parametrize("name", list(MESHES))
def test_mesh_matches_one_process(name, reference):
    """float64: the ranks sum the same token losses in another order, so losses agree to ~1e-12
    and parameters after 3 AdamW steps to 1e-9 (Adam divides tiny gradients by their own scale,
    which keeps relative errors of that order)."""
    sizes = MESHES[name]
    world = tf.Mesh(**sizes).world_size
    results = spawn(_train, world, sizes)
    ref_losses, ref_params = reference
    for losses, params in results:
        assert losses == pytest.approx(ref_losses, rel=1e-11)
        assert params.keys() == ref_params.keys()
        for n, p in params.items():
            torch.testing.assert_close(p, ref_params[n], rtol=1e-9, atol=1e-11, msg=n)


def _shards_and_specs(mesh_sizes):
    mesh = tf.Mesh(**mesh_sizes)
    model = tf.models.from_hf_config(tiny_config("qwen2"), seed=0, device="cpu")
    full = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    state = tf.init(model, tf.optim.adamw(1e-3), mesh)
    specs = param_specs(full, model.config, mesh)
    coords = mesh.coords(rank())
    mismatched = [
        n
        for n, p in state.params.items()
        if not torch.equal(p.to_local(), local_specs(full[n], specs[n], coords, mesh))
    ]
    back = tf.unshard(state)
    return mismatched, all(torch.equal(back[n], full[n]) for n in full)


@pytest.mark.parametrize("name", ["fsdp2", "fsdp2xtp2", "dp2", "dp2xtp2"])
def test_local_specs_predict_every_rank_shard_and_unshard_inverts(name):
    world = tf.Mesh(**MESHES[name]).world_size
    for mismatched, round_trip in spawn(_shards_and_specs, world, MESHES[name]):
        assert mismatched == []
        assert round_trip


def _shard_existing_state():
    mesh = tf.Mesh(fsdp=2)
    state = _state(tf.Mesh())
    batch = pack(random_features(4, seed=7))
    state, _ = tf.step(state, tf.fwd_bwd(state, batch)[0])
    full_mu = {n: t.clone() for n, t in state.opt_state[1].mu.items()}
    sharded = tf.shard(state, mesh)
    mu = sharded.opt_state[1].mu
    same = all(torch.equal(mu[n].full_tensor(), full_mu[n]) for n in full_mu)
    return same, int(sharded.step), state.donated


def test_shard_moves_an_existing_state_with_its_optimizer_state():
    for same, step, donated in spawn(_shard_existing_state, 2):
        assert same and step == 1 and donated


def _bad_tp():
    _state(tf.Mesh(tp=4), family="qwen2")


def test_tp_that_does_not_divide_heads_is_named():
    # tiny_config has 4 attention heads but 2 key/value heads
    with pytest.raises(RuntimeError, match="tp=4 does not divide the 2 key/value heads"):
        spawn(_bad_tp, 4)


def _train_bf16(mesh_sizes):
    return _train(mesh_sizes, precision="bf16", dtype=torch.float32)


def test_bf16_mixed_precision_on_fsdp2_tracks_one_process():
    """bf16 compute with float32 master weights and float32 gradient reduction: losses follow the
    one-process bf16 run to bf16 accuracy (8 mantissa bits: ~1e-2 relative after 3 steps)."""
    ref_losses, _ = _train({}, precision="bf16", dtype=torch.float32)
    for losses, params in spawn(_train_bf16, 2, {"fsdp": 2}):
        assert losses == pytest.approx(ref_losses, rel=2e-2)
        assert all(p.dtype == torch.float32 for p in params.values())


def _train_tied_with_evals(mesh_sizes):
    """Tied embeddings (one parameter in two modules), and forward-only evaluations between
    steps (FSDP2 swaps gathered parameters into the module during a forward)."""
    mesh = tf.Mesh(**mesh_sizes)
    model = tf.models.from_hf_config(
        tiny_config("qwen2", tie_word_embeddings=True), seed=0, device="cpu"
    )
    model.module.to(torch.float64)
    state = tf.init(model, tf.optim.adamw(1e-2), mesh)
    evals = []
    for i in range(STEPS):
        feats = random_features(8, seed=100 + i)
        mine = feats[mesh.get_slice(len(feats), rank())] if mesh.world_size > 1 else feats
        evals.append(float(tf.evaluate(state, pack(feats)).loss_sum))
        state, _ = tf.step(state, tf.fwd_bwd(state, pack(mine))[0])
    return evals, tf.unshard(state)


def test_tied_embeddings_and_evaluation_between_steps_on_fsdp2():
    ref_evals, ref_params = _train_tied_with_evals({})
    for evals, params in spawn(_train_tied_with_evals, 2, {"fsdp": 2}):
        assert evals == pytest.approx(ref_evals, rel=1e-11)
        for n, p in params.items():
            torch.testing.assert_close(p, ref_params[n], rtol=1e-9, atol=1e-11, msg=n)


def _train_micro(mesh_sizes):
    return _train(mesh_sizes, micro=2)


@pytest.mark.parametrize("name", ["tp2+sp", "fsdp2"])
def test_accumulated_micro_batches_on_a_mesh_match_one_process(name, reference):
    """Two micro-batches per rank accumulate into the grads of the whole global batch."""
    ref_losses, ref_params = reference
    for losses, params in spawn(_train_micro, 2, MESHES[name]):
        assert losses == pytest.approx(ref_losses, rel=1e-11)
        for n, p in params.items():
            torch.testing.assert_close(p, ref_params[n], rtol=1e-9, atol=1e-11, msg=n)


def _train_fp16(mesh_sizes):
    return _train(mesh_sizes, precision="fp16", dtype=torch.float32)


def test_fp16_with_loss_scaling_on_fsdp2_tracks_one_process():
    """float16 compute, dynamic loss scale, float32 master weights and reductions: every rank
    sees the same global grad norm, so all skip or step together; losses follow one process to
    fp16 accuracy."""
    ref_losses, _ = _train({}, precision="fp16", dtype=torch.float32)
    for losses, _ in spawn(_train_fp16, 2, {"fsdp": 2}):
        assert losses == pytest.approx(ref_losses, rel=2e-2)


def _sharded_between_forward_and_backward(mesh_sizes):
    """Per decoder layer: is its parameter sharded again between the forward and the backward?"""
    from torch.distributed.tensor import DTensor

    from twinkle_fn.backends.transformers import compute

    state = _state(tf.Mesh(**mesh_sizes))
    out = compute.loss_of(state, pack(random_features(2)))
    layers = state.model.module.get_decoder().layers
    sharded = [isinstance(layer.mlp.up_proj.weight, DTensor) for layer in layers]
    out.loss_sum.backward()
    return sharded


@pytest.mark.parametrize(("name", "expected"), [("dp2", [False, False]), ("fsdp2", [True, False])])
def test_only_an_fsdp_axis_reshards_layers_after_forward(name, expected):
    """Sharding parameters again after the forward saves memory only when they are sharded; on
    a dp-only mesh it would copy them in twice per step. The last layer never reshards (its
    backward comes right after the forward)."""
    for sharded in spawn(_sharded_between_forward_and_backward, 2, MESHES[name]):
        assert sharded == expected


def test_sequence_parallel_is_refused_where_the_family_row_says_so():
    with pytest.raises(ValueError, match="a qwen3_moe model needs the megatron backend"):
        _check_sequence_parallel(tf.models.from_hf_config(tiny_config("qwen3_moe"), seed=0))
    config = tiny_config("qwen2")
    _check_sequence_parallel(tf.models.from_hf_config(config, seed=0))
    config.model_type = "qwen2_no_sp"
    row = dataclasses.replace(family("qwen2"), name="qwen2_no_sp", sequence_parallel=False)
    with registered(row), pytest.raises(ValueError, match="a qwen2_no_sp model needs"):
        _check_sequence_parallel(tf.models.from_hf_config(config, seed=0))


def test_the_rotary_key_gradient_is_summed_where_a_layer_has_a_latent_kv_projection():
    """Multi-latent attention's layers get `SharedRotaryKey` over the rotary key's width
    (parity on tp2: tests/test_family_conformance.py); other layers nothing."""
    config = tiny_config("deepseek_v3")
    layers = tf.models.from_hf_config(config, seed=0).module.model.layers
    for layer in layers:
        styles = _shared_key_styles(layer, config)
        assert styles.keys() == {LATENT_KV} and isinstance(styles[LATENT_KV], SharedRotaryKey)
        assert styles[LATENT_KV].width == config.qk_rope_head_dim == 4
    qwen = tf.models.from_hf_config(tiny_config("qwen2"), seed=0).module.model.layers[0]
    assert _shared_key_styles(qwen, tiny_config("qwen2")) == {}


PG = tf.losses.policy_gradient(entropy_coef=0.1)


def _train_pg(mesh_sizes):
    return _train(mesh_sizes, loss=PG)


@pytest.fixture(scope="module")
def pg_reference():
    return _train_pg({})


@pytest.mark.parametrize("name", ["fsdp2", "tp2"])
def test_a_token_loss_on_a_mesh_matches_one_process(name, pg_reference):
    """The policy-gradient loss with its entropy bonus (logits gathered from tp, fields of each
    rank's slice): the tolerances of `test_mesh_matches_one_process` (float64)."""
    ref_losses, ref_params = pg_reference
    for losses, params in spawn(_train_pg, 2, MESHES[name]):
        assert losses == pytest.approx(ref_losses, rel=1e-11)
        for n, p in params.items():
            torch.testing.assert_close(p, ref_params[n], rtol=1e-9, atol=1e-11, msg=n)
