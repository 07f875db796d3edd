"""Overlapped gradient reduction on two real gloo ranks (dp2, float32) equals the reduction that
``step`` runs all at once, across micro-batches of one call and across accumulating calls.

Both runs use the same bucket layout (``grad_bucket_size``, several buckets), so within one call
each element is the same two-term sum in both: bit-identical. Accumulation reduces each call's
sum and adds them (``R(g1) + R(g2)``) instead of reducing the total (``R(g1 + g2)``): float32
rounding of the same sums in another order. The first step's reduced gradients agree to 2e-8
absolute, 3e-7 of the largest (observed 7.5e-9). After 3 steps losses and grad norms agree to
1e-5 relative (observed 1.5e-6), SGD's weights to 1e-6 absolute (observed 6e-8), Adam's to 2e-4
(observed 2.3e-5: Adam moves an element whose gradient is almost zero by up to lr on the sign of
rounding noise; the megatron backend's parity tests use the same bound).
"""

import os
import traceback
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup, shard_buffer

import twinkle_fn as tf
from twinkle_fn.backends.megatron import parallel
from twinkle_fn.backends.megatron.backend import MegatronOptState, megatron_optimizer
from twinkle_fn.backends.megatron.grad_sync import finish_backward
from twinkle_fn.data import pack
from twinkle_fn.distributed import rank
from twinkle_fn.testing import random_features, tiny_config
from twinkle_fn.testing_dist import free_port, spawn

STEPS = 3
BUCKET = 5000  # elements: the tiny model's ~20k gradients in several buckets
HOWS = ("micro", "accum")  # 2 micro-batches in one call; 2 calls of 2 micro-batches each


def _tx(kind):
    if kind == "megatron":
        return megatron_optimizer(1e-2, clip_grad=1.0)
    return tf.optim.sgd(0.5)


def _reduced(state):
    """This rank's reduced part of every bucket: its shard (megatron's optimizer) or all."""
    chunk = state.model.placement.chunks[0]
    parts = []
    for group in chunk.bucket_groups:
        for bucket in group.buckets:
            data = bucket.grad_data
            if isinstance(state.opt_state, MegatronOptState):
                size = group.intra_distributed_optimizer_instance_size
                data = shard_buffer(data, size)[group.intra_distributed_optimizer_instance_rank]
            parts.append(data.to("cpu", copy=True))
    return torch.cat(parts)


def _run(kind, how, overlap, tamper=None, device="cpu"):
    """STEPS steps; `tamper(state)` runs before the last step's backward. Returns the infos,
    the first step's reduced gradients, the weights, the bucket count and, per API call, which
    bucket reductions started inside a backward."""
    options = dict(num_micro_batches=2, grad_bucket_size=BUCKET, overlap_grad_reduce=overlap)
    model = tf.models.from_hf_config(
        tiny_config("qwen2"), seed=0, backend="megatron", options=options, device=device
    )
    mesh = tf.Mesh(dp=2)
    state = tf.init(model, _tx(kind), mesh)
    starts, calls, infos, first = [], [], [], None
    original = _ParamAndGradBucketGroup.start_grad_sync

    def recorded(group, *args, **kwargs):
        starts.append(torch._C._current_graph_task_id() != -1)
        return original(group, *args, **kwargs)

    def call(fn, *args, **kwargs):
        starts.clear()
        out = fn(*args, **kwargs)
        calls.append(list(starts))
        return out

    _ParamAndGradBucketGroup.start_grad_sync = recorded
    try:
        for step in range(STEPS):
            if tamper is not None and step == STEPS - 1:
                tamper(state)
            feats = random_features(8, seed=100 + step)[mesh.get_slice(8, rank())]
            parts = [feats[:2], feats[2:]] if how == "accum" else [feats]
            grads = None
            for part in parts:
                grads, _ = call(tf.fwd_bwd, state, pack(part), accum=grads)
            state, info = call(tf.step, state, grads)
            first = _reduced(state) if first is None else first
            infos.append((float(info["loss"]), float(info["grad_norm"])))
    finally:
        _ParamAndGradBucketGroup.start_grad_sync = original
        buckets = len(state.model.placement.chunks[0].bucket_groups)
        params = tf.unshard(state)
        parallel.destroy()
    return dict(infos=infos, first=first, params=params, buckets=buckets, calls=calls)


def _one_more_gradient(state):
    """Expect one more gradient of one parameter than arrives: its bucket is never dispatched
    during backward, and must be reduced afterwards."""
    group = state.model.placement.chunks[0].bucket_groups[0]
    param = next(iter(group.golden_per_param_grad_ready_counts))
    group.golden_per_param_grad_ready_counts[param] += 1


def _ranks(device="cpu"):
    runs = {
        (kind, how, overlap): _run(kind, how, overlap, device=device)
        for kind in ("megatron", "sgd")
        for how in HOWS
        for overlap in (False, True)
    }
    runs["late"] = _run("megatron", "micro", True, _one_more_gradient, device=device)
    return runs


@pytest.fixture(scope="module")
def runs():
    return spawn(_ranks, 2, timeout_s=300)


def _assert_same(got, want, *, exact, param_atol, first_atol=2e-8):
    assert got["buckets"] == want["buckets"] > 2
    if exact:
        assert got["infos"] == want["infos"]
        assert torch.equal(got["first"], want["first"])
        assert all(torch.equal(p, want["params"][n]) for n, p in got["params"].items())
        return
    for (loss, norm), (ref_loss, ref_norm) in zip(got["infos"], want["infos"], strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert norm == pytest.approx(ref_norm, rel=1e-5)
    torch.testing.assert_close(got["first"], want["first"], rtol=0, atol=first_atol)
    for n, p in got["params"].items():
        torch.testing.assert_close(p, want["params"][n], rtol=0, atol=param_atol, msg=n)


@pytest.mark.parametrize("kind", ["megatron", "sgd"])
@pytest.mark.parametrize("how", HOWS)
def test_overlapped_reduction_equals_the_reduction_in_step(runs, kind, how):
    for per_rank in runs:
        got, want = per_rank[kind, how, True], per_rank[kind, how, False]
        atol = 2e-4 if kind == "megatron" else 1e-6
        _assert_same(got, want, exact=how == "micro", param_atol=atol)


@pytest.mark.parametrize("how", HOWS)
def test_reductions_start_inside_backward_from_the_second_call_on(runs, how):
    """The first call learns how many gradients each parameter gets, so its buckets are
    reduced after its backward; every later call reduces every bucket inside its backward.
    Without overlap ``step`` reduces them all."""
    calls_per_step = 3 if how == "accum" else 2
    for per_rank in runs:
        on, off = per_rank["megatron", how, True], per_rank["megatron", how, False]
        buckets = on["buckets"]
        assert on["calls"][0] == [False] * buckets
        for i, starts in enumerate(on["calls"][1:], start=1):
            is_step = i % calls_per_step == calls_per_step - 1
            assert starts == ([] if is_step else [True] * buckets)
        for i, starts in enumerate(off["calls"]):
            is_step = i % calls_per_step == calls_per_step - 1
            assert starts == ([False] * buckets if is_step else [])


def test_a_bucket_missing_a_gradient_is_reduced_after_backward(runs):
    for per_rank in runs:
        late, want = per_rank["late"], per_rank["megatron", "micro", False]
        assert late["calls"][-2] == [True] * (late["buckets"] - 1) + [False]
        _assert_same(late, want, exact=True, param_atol=0)


class _Group:
    """A bucket group after a backward, as `finish_backward` reads it."""

    def __init__(self, counts, golden, dispatched):
        self.is_first_batch, self.grad_reduce_finished = False, False
        self.per_param_grad_ready_counts, self.golden_per_param_grad_ready_counts = counts, golden
        self.grad_reduce_handle = object() if dispatched else None
        self.log = []

    def start_grad_sync(self, force_all_reduce):
        self.grad_reduce_handle = object()
        self.log.append("start")

    def finish_grad_sync(self, force_all_reduce):
        self.grad_reduce_handle, self.grad_reduce_finished = None, True
        self.log.append("finish")


def _chunk(*groups):
    return SimpleNamespace(
        bucket_groups=list(groups), expert_parallel_bucket_groups=[], force_all_reduce=False
    )


def test_a_bucket_reduced_before_its_last_gradient_raises():
    """A parameter got more gradients than in the first call, so its bucket was dispatched
    early: every reduction is still waited for, then the call fails."""
    early = _Group({"w": 2}, {"w": 1}, dispatched=True)
    fine = _Group({"v": 1}, {"v": 1}, dispatched=True)
    with pytest.raises(RuntimeError, match=r"1 gradient bucket.*graph changed"):
        finish_backward([_chunk(early, fine)])
    assert early.log == fine.log == ["finish"]


def test_an_undispatched_bucket_is_started_then_waited_for():
    late = _Group({"w": 1}, {"w": 2}, dispatched=False)
    finish_backward([_chunk(late)])
    assert late.log == ["start", "finish"]


def _nccl_rank(rank, port, queue):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )  # fmt: skip
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl", rank=rank, world_size=2)
    try:
        queue.put((rank, _ranks("cuda")))
    except BaseException:
        queue.put((rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA devices (NCCL's asynchronous reductions)",
)
def test_overlapped_reduction_over_nccl_equals_the_reduction_in_step():
    """The same runs on 2 GPUs over NCCL, float32 without TF32. GPU backward kernels may add in
    another order from run to run (atomics), so every comparison takes a tolerance: the first
    step's reduced gradients agree to 1e-6 absolute (1.5% of the largest, 0.07; a reduction done
    twice or missed would be off by the gradients themselves), losses and grad norms to 1e-5
    relative, weights to 2e-4 (Adam) and 1e-5 (SGD)."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_nccl_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=600) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
    for per_rank in results.values():
        assert isinstance(per_rank, dict), per_rank  # else a rank's traceback
        for kind in ("megatron", "sgd"):
            for how in HOWS:
                got, want = per_rank[kind, how, True], per_rank[kind, how, False]
                atol = 2e-4 if kind == "megatron" else 1e-5
                _assert_same(got, want, exact=False, first_atol=1e-6, param_atol=atol)
