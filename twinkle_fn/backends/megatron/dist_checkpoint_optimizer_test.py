"""`optimizer_params` places every parameter's main copy and Adam moments at its own offset in
model space, across grad buckets, and `load_optimizer` writes them back with a step tensor per
parameter; saving, loading and resharding them on other meshes is `dist_checkpoint_test`'s.
One process (megatron_world), float32: the main copies equal the parameters exactly."""

import pytest
import torch

import twinkle_fn as tf
from twinkle_fn.backends.megatron import parallel
from twinkle_fn.backends.megatron.dist_checkpoint_optimizer import (
    load_optimizer,
    optimizer_common,
    optimizer_params,
)
from twinkle_fn.backends.megatron.optimizer import megatron_optimizer
from twinkle_fn.data import pack
from twinkle_fn.testing import random_features, tiny_config

MOMENTS = ("exp_avg", "exp_avg_sq")


@pytest.fixture(scope="module")
def stepped(megatron_world):
    """A tiny qwen2 state after one step, its gradients in several buckets of 4096 elements."""
    model = tf.models.from_hf_config(
        tiny_config("qwen2"), seed=0, backend="megatron", options={"grad_bucket_size": 4096}
    )
    state = tf.init(model, megatron_optimizer(1e-2))
    grads, _ = tf.fwd_bwd(state, pack(random_features(4, seed=1)))
    state, _ = tf.step(state, grads)
    try:
        yield state
    finally:
        parallel.destroy()


def _main_state(opt):
    """Every main parameter's optimizer slot, over megatron's chain of sub-optimizers."""
    return [s for sub in opt.optimizer.chained_optimizers for s in sub.optimizer.state.values()]


def test_every_parameter_gets_its_own_main_copy_and_moments(stepped):
    placement, opt = stepped.model.placement, stepped.opt_state
    assert len(placement.chunks[0].buffers[0].buckets) > 1
    model = placement.module.sharded_state_dict()
    params = optimizer_params(placement, opt, model, fill=True)
    named = dict(placement.module.named_parameters())
    assert params.keys() == named.keys()
    for name, entry in params.items():
        assert {e.key for e in entry.values()} == {
            f"optimizer.state.{n}.{model[name].key}" for n in ("fp32_param", *MOMENTS)
        }
        assert torch.equal(entry["fp32_param"].data, named[name]), name
    # every moment element placed once: the same multiset as the optimizer's own tensors
    for moment in MOMENTS:
        placed = torch.cat([e[moment].data.reshape(-1) for e in params.values()])
        own = torch.cat([s[moment].reshape(-1) for s in _main_state(opt)])
        assert placed.abs().sum() > 0
        assert torch.equal(placed.sort().values, own.sort().values), moment


def test_a_load_writes_the_moments_back_with_a_step_per_parameter(stepped):
    placement, opt = stepped.model.placement, stepped.opt_state
    model = placement.module.sharded_state_dict()
    empty = optimizer_params(placement, opt, model, fill=False)
    assert all(not t.data.any() for entry in empty.values() for t in entry.values())
    saved = optimizer_params(placement, opt, model, fill=True)
    common = optimizer_common(opt)
    doubled = {
        name: {n: sh.data * (2 if n in MOMENTS else 1) for n, sh in entry.items()}
        for name, entry in saved.items()
    }
    load_optimizer(placement, opt, {"params": doubled, "common": common})
    again = optimizer_params(placement, opt, model, fill=True)
    for name, entry in again.items():
        for n, sh in entry.items():
            assert torch.equal(sh.data, doubled[name][n]), (name, n)
    assert optimizer_common(opt)["step"] == common["step"]
    steps = [s["step"] for s in _main_state(opt) if isinstance(s.get("step"), torch.Tensor)]
    assert len({id(t) for t in steps}) == len(steps)
