"""`tf.export_weights` on the megatron backend, on real gloo ranks: after two training steps on
each mesh, the stream loaded into a plain HF model on every rank gives the trainer's per-token
log-probabilities (float32, 1e-5 absolute: see `twinkle_fn.export_test`), buckets stay within
their bound and the largest is far below the model. One spawned world of two ranks runs every
mesh in turn (megatron-core takes seconds to import).
"""

import tempfile

import pytest
import torch

import twinkle_fn as tf
from twinkle_fn.backends.megatron import parallel
from twinkle_fn.backends.megatron.backend import megatron_optimizer
from twinkle_fn.distributed import rank
from twinkle_fn.export_test import LOGPS_ATOL, LORA, batch, consume, hf_logps, model_bytes, train
from twinkle_fn.testing import tiny_config
from twinkle_fn.testing_dist import spawn

BOUND = 16 << 10
# name -> (family, mesh sizes, backend options, lora)
MESHES = {
    "tp2": ("qwen2", {"tp": 2}, {}, None),
    "pp2": ("qwen2", {"pp": 2}, {"num_micro_batches": 2}, None),
    "dp2": ("qwen2", {"dp": 2}, {}, None),
    "ep2": ("qwen3_moe", {"dp": 2, "ep": 2}, {}, None),
    "tp2-lora": ("qwen2", {"tp": 2}, {}, "merged"),
}


def _mesh_run(family, sizes, options, lora):
    config = tiny_config(family)
    mesh = tf.Mesh(**sizes)
    model = tf.models.from_hf_config(config, seed=0, backend="megatron", options=options)
    if lora:
        model = tf.lora.add_lora(model, LORA)
    mine = lambda f: f[mesh.get_slice(len(f), rank())]  # noqa: E731
    state = train(model, mesh, feats_of=mine, tx=megatron_optimizer(1e-2))
    out = {}
    if lora:
        separate = [kv for b in tf.export_weights(state, dtype=torch.float32) for kv in b]
        want = tf.lora.adapter_state_dict(state)
        out["separate_names"] = [n for n, _ in separate] == list(want)
        out["separate_diff"] = max((t - want[n]).abs().max().item() for n, t in separate)
    stream = tf.export_weights(state, dtype=torch.float32, bucket_bytes=BOUND, lora="merged")
    with tempfile.TemporaryDirectory() as files:
        hf, out["largest"] = consume(
            stream, config, BOUND, files if family == "qwen3_moe" else None
        )
    want = tf.token_logps(state, batch())["logps"]
    out["diff"] = (hf_logps(hf, batch()) - want).abs().max().item()
    parallel.destroy()
    return out


def _two_ranks():
    return {name: _mesh_run(*spec) for name, spec in MESHES.items()}


@pytest.fixture(scope="module")
def two_ranks():
    return spawn(_two_ranks, 2, timeout_s=600)


@pytest.mark.parametrize("name", MESHES)
def test_every_rank_loads_the_trainer_weights(two_ranks, name):
    family = MESHES[name][0]
    total, biggest = model_bytes(tiny_config(family))
    for per_rank in two_ranks:
        out = per_rank[name]
        assert out["diff"] <= LOGPS_ATOL
        assert out["largest"] <= max(BOUND, biggest) and out["largest"] < total / 2
        if "separate_names" in out:
            assert out["separate_names"] and out["separate_diff"] == 0


def _four_ranks():
    return _mesh_run("qwen2", {"tp": 2, "pp": 2}, {"num_micro_batches": 2}, None)


def test_tp2_pp2_every_rank_loads_the_trainer_weights():
    """Both splits at once: each stage gathers its tp shards, then broadcasts over the pipeline."""
    total, biggest = model_bytes(tiny_config("qwen2"))
    for out in spawn(_four_ranks, 4, timeout_s=600):
        assert out["diff"] <= LOGPS_ATOL
        assert out["largest"] <= max(BOUND, biggest) and out["largest"] < total / 2
