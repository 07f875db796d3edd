"""`tf.export_weights` on the transformers backend, on real gloo ranks (FSDP2 and tp2 meshes,
LoRA merged): after two training steps every rank loads the stream into a plain HF model with
the trainer's per-token log-probabilities (float32, 1e-5 absolute: see `twinkle_fn.export_test`),
and a consumer in another process, joined to trainer rank 0 by a group of its own (as a rollout
engine is), builds its model from the buckets rank 0 broadcasts to it.
"""

import datetime
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import twinkle_fn as tf
from twinkle_fn.distributed import rank
from twinkle_fn.export_test import LOGPS_ATOL, LORA, batch, consume, hf_logps, model_bytes, train
from twinkle_fn.testing import tiny_config
from twinkle_fn.testing_dist import free_port, spawn

BOUND = 16 << 10
# name -> (mesh sizes, lora)
MESHES = {
    "fsdp2": ({"fsdp": 2}, False),
    "tp2": ({"tp": 2}, False),
    "fsdp2-lora": ({"fsdp": 2}, True),
}


def _sync_group(port, group_rank):
    """A two-process gloo group (trainer rank 0 = 0, consumer = 1) beside any default group, and
    its store (the trainer's rank hosts it); bucket names and shapes travel through the store."""
    store = dist.TCPStore("127.0.0.1", port, 2, group_rank == 0, datetime.timedelta(seconds=120))
    group = dist.ProcessGroupGloo(dist.PrefixStore("pg", store), group_rank, 2)
    return store, group


def _broadcast(group, tensor):
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def _consumer(ports, results):
    """The engine's side, one process for every mesh in turn (one interpreter start, not one
    per mesh): for each of `ports`, buckets from the trainer until it says none is left, loaded
    as they come (`consume`), then the log-probs of the shared batch."""
    for port in ports:
        store, group = _sync_group(port, 1)

        def received(store=store, group=group):
            for i in range(10**6):
                meta = pickle.loads(store.get(f"bucket{i}"))
                if meta is None:
                    return
                bucket = [(n, torch.empty(shape, dtype=dtype)) for n, shape, dtype in meta]
                for _, tensor in bucket:
                    _broadcast(group, tensor)
                yield bucket

        # The trainer's config names its own attention kernel: an engine builds from a fresh one.
        hf, _ = consume(received(), tiny_config("qwen2"), BOUND)
        # A numpy array pickles by value; a tensor would travel as a shared-memory handle whose
        # sender may exit before the parent opens it.
        results.put(hf_logps(hf, batch()).numpy())


def _send(stream, store, group):
    """Every rank iterates the stream (a collective); rank 0 forwards each bucket."""
    i = 0
    for i, bucket in enumerate(stream):
        if group is not None:
            meta = [(n, tuple(t.shape), t.dtype) for n, t in bucket]
            store.set(f"bucket{i}", pickle.dumps(meta))
            for _, tensor in bucket:
                _broadcast(group, tensor.contiguous())
    if group is not None:
        store.set(f"bucket{i + 1}", pickle.dumps(None))


def _mesh_run(sizes, lora, port, results):
    config = tiny_config("qwen2")
    mesh = tf.Mesh(**sizes)
    model = tf.models.from_hf_config(config, seed=0)
    if lora:
        model = tf.lora.add_lora(model, LORA)
    state = train(model, mesh, feats_of=lambda f: f[mesh.get_slice(len(f), rank())])
    stream = tf.export_weights(state, dtype=torch.float32, bucket_bytes=BOUND, lora="merged")
    hf, largest = consume(stream, config, BOUND)
    want = tf.token_logps(state, batch())["logps"]
    out = {"diff": (hf_logps(hf, batch()) - want).abs().max().item(), "largest": largest}
    # The consumer process, fed by rank 0 (the second export: a stream can be drawn again).
    store, group = _sync_group(port, 0) if rank() == 0 else (None, None)
    _send(
        tf.export_weights(state, dtype=torch.float32, bucket_bytes=BOUND, lora="merged"),
        store,
        group,
    )
    if rank() == 0:
        out["remote_diff"] = (torch.from_numpy(results.get(timeout=120)) - want).abs().max().item()
    return out


def _two_ranks(ports):
    consumer = results = None
    if rank() == 0:
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        consumer = ctx.Process(target=_consumer, args=([ports[n] for n in MESHES], results))
        consumer.start()
    out = {name: _mesh_run(*spec, ports[name], results) for name, spec in MESHES.items()}
    if consumer is not None:
        consumer.join(timeout=60)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return spawn(_two_ranks, 2, {name: free_port() for name in MESHES}, timeout_s=600)


@pytest.mark.parametrize("name", MESHES)
def test_every_rank_and_a_remote_consumer_load_the_trainer_weights(two_ranks, name):
    total, biggest = model_bytes(tiny_config("qwen2"))
    for per_rank in two_ranks:
        out = per_rank[name]
        assert out["diff"] <= LOGPS_ATOL
        assert out["largest"] <= max(BOUND, biggest) and out["largest"] < total / 2
    assert two_ranks[0][name]["remote_diff"] <= LOGPS_ATOL


def _moe_exports(model_dir):
    """The exports (float32, name -> tensor) of one qwen3_moe checkpoint on either backend,
    one process (megatron needs its process group)."""
    # Here, not at the top: megatron-core takes seconds to import, and only this test needs it.
    from twinkle_fn.backends.megatron import parallel
    from twinkle_fn.optim import megatron_optimizer

    hf = tf.models.from_hf_config(tiny_config("qwen3_moe"), seed=0)
    hf.module.save_pretrained(model_dir)
    gpt = tf.models.from_pretrained(model_dir, backend="megatron")
    out = {}
    for backend, model, tx in [
        ("transformers", hf, tf.optim.adamw(1e-2)),
        ("megatron", gpt, megatron_optimizer(1e-2)),
    ]:
        stream = tf.export_weights(tf.init(model, tx), dtype=torch.float32, bucket_bytes=BOUND)
        out[backend] = [kv for bucket in stream for kv in bucket]
    parallel.destroy()
    return out


def test_moe_export_has_the_checkpoint_names_of_the_megatron_backend(tmp_path):
    """Both backends export qwen3_moe's experts one tensor per expert, as the checkpoint (and a
    rollout engine) names them, not as transformers fuses them in memory."""
    out = spawn(_moe_exports, 1, str(tmp_path / "moe"), timeout_s=300)[0]
    mine, theirs = dict(out["transformers"]), dict(out["megatron"])
    assert len(mine) == len(out["transformers"])  # each name once
    assert sorted(mine) == sorted(theirs)
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in mine
    assert not any(n.endswith("experts.gate_up_proj") for n in mine)
    for name, tensor in mine.items():
        assert torch.equal(tensor, theirs[name]), name
