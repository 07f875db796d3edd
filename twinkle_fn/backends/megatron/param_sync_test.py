"""Parameter all-gathers left in flight after the distributed optimizer's step (dp2, float32,
two real gloo ranks) give the same training as megatron's synchronous gathers.

Both runs gather the same shards into the same buffers, so every loss and weight is
bit-identical; the gathers only move in time. Several buckets (``grad_bucket_size``) check that
the next forward waits for each bucket's gather, in the order it uses them.
"""

from types import SimpleNamespace

import pytest
import torch

import twinkle_fn as tf
from twinkle_fn.backends.megatron import parallel, param_sync
from twinkle_fn.backends.megatron.backend import megatron_optimizer
from twinkle_fn.backends.megatron.placement import model_placement
from twinkle_fn.data import pack
from twinkle_fn.distributed import rank
from twinkle_fn.testing import random_features, tiny_config
from twinkle_fn.testing_dist import spawn

STEPS = 3
BUCKET = 5000  # elements: the tiny model's ~20k parameters in several buckets


def _run(gather):
    mesh = tf.Mesh(dp=2)
    options = {"overlap_param_gather": gather, "grad_bucket_size": BUCKET}
    model = tf.models.from_hf_config(
        tiny_config("qwen2"), seed=0, backend="megatron", options=options
    )
    state = tf.init(model, megatron_optimizer(1e-2, clip_grad=1.0), mesh)
    chunks = model_placement(state.model).chunks
    losses, in_flight = [], []
    for i in range(STEPS):
        feats = random_features(8, seed=30 + i)[mesh.get_slice(8, rank())]
        grads, _ = tf.fwd_bwd(state, pack(feats))
        state, info = tf.step(state, grads)
        losses.append(float(info["loss"]))
        in_flight.append(param_sync.in_flight(chunks))
    weights = tf.unshard(state)
    groups = len(chunks[0].bucket_groups)
    refused = ""
    if not gather:
        try:
            param_sync.enable(chunks[0])
        except ValueError as e:
            refused = str(e)
    parallel.destroy()
    return losses, weights, in_flight, groups, refused


def _both():
    return _run(False), _run(True)


@pytest.fixture(scope="module")
def runs():
    return spawn(_both, 2, timeout_s=300)


def test_overlapped_gathers_train_bit_identically(runs):
    for (losses, weights, *_), (g_losses, g_weights, *_) in runs:
        assert g_losses == losses
        assert weights.keys() == g_weights.keys()
        for name, w in weights.items():
            assert torch.equal(g_weights[name], w), name


def test_every_bucket_is_in_flight_after_a_step_and_none_without_overlap(runs):
    for (_, _, in_flight, groups, _), (_, _, g_in_flight, g_groups, _) in runs:
        assert groups == g_groups > 1
        assert in_flight == [0] * STEPS
        assert g_in_flight == [g_groups] * STEPS


def test_a_ddp_without_overlap_is_refused(runs):
    for (*_, refused), _ in runs:
        assert "overlap_param_gather=True" in refused


class _Group:
    def __init__(self, name, started):
        self.name, self.started = name, started
        self.param_gather_handle, self.param_gather_dispatched = None, False

    def start_param_sync(self):
        self.started.append(self.name)
        self.param_gather_handle = object()


def test_gathers_are_dispatched_in_forward_order():
    """megatron's buckets are in backward order; the forward needs the last one first."""
    started = []
    dense = [_Group(f"dense{i}", started) for i in range(3)]
    expert = [_Group(f"expert{i}", started) for i in range(2)]
    chunk = SimpleNamespace(bucket_groups=dense, expert_parallel_bucket_groups=expert)
    param_sync.start([chunk])
    assert started == ["dense2", "dense1", "dense0", "expert1", "expert0"]
    assert param_sync.in_flight([chunk]) == 5
