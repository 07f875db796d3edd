"""`tf.offload` / `tf.reload`: memory leaves and comes back bit-identical, training continues as if
nothing happened, and a parked state cannot be used. Both backends; the megatron one in a spawned
process (its global state stays out of the test runner)."""

import pytest
import torch

import twinkle_fn as tf
from twinkle_fn.data import pack
from twinkle_fn.testing import random_features, tiny_config
from twinkle_fn.testing_dist import spawn


def _batch(seed):
    return pack(random_features(4, seed=seed))


def _train(state, seeds, park=None):
    """One step per seed; `park(state) -> state` runs between steps. Returns (state, losses)."""
    losses = []
    for seed in seeds:
        grads, _ = tf.fwd_bwd(state, _batch(seed))
        state, info = tf.step(state, grads)
        losses.append(float(info["loss"]))
        if park is not None:
            state = park(state)
    return state, losses


def _state(backend):
    model = tf.models.from_hf_config(tiny_config("qwen2"), seed=0, backend=backend)
    if backend == "megatron":
        from twinkle_fn.optim import megatron_optimizer

        return tf.init(model, megatron_optimizer(1e-2))
    return tf.init(model, tf.optim.adamw(1e-2))


def _storage_bytes(tensors):
    return [t.untyped_storage().nbytes() for t in tensors]


def _park_and_check(state, seen):
    """Offload everything, record what is parked, reload."""
    before = {n: p.detach().clone() for n, p in state.params.items()}
    grads = [p.main_grad for p in state.params.values() if hasattr(p, "main_grad")]
    parked = tf.offload(state)
    seen.append(
        dict(
            param_bytes=_storage_bytes(parked.state.params.values()),
            grad_bytes=_storage_bytes(grads),
            nbytes=parked.nbytes,
        )
    )
    with pytest.raises(tf.DonatedError, match=r"tf\.offload"):
        tf.fwd_bwd(state, _batch(0))
    state = tf.reload(parked)
    with pytest.raises(tf.DonatedError, match=r"tf\.reload"):
        tf.reload(parked)
    seen[-1]["identical"] = all(torch.equal(before[n], p) for n, p in state.params.items())
    return state


def _run(backend):
    """Losses and final params with and without parking between steps, and what was seen."""
    plain, plain_losses = _train(_state(backend), (1, 2, 3))
    seen = []
    parked, parked_losses = _train(
        _state(backend), (1, 2, 3), park=lambda s: _park_and_check(s, seen)
    )
    same = all(torch.equal(plain.params[n], p) for n, p in parked.params.items())
    if backend == "megatron":
        from twinkle_fn.backends.megatron import parallel

        parallel.destroy()
    return dict(losses=(plain_losses, parked_losses), same_params=same, seen=seen)


def _check(result, expect_grads):
    plain, parked = result["losses"]
    assert plain == parked  # bit-exact: the same bytes come back
    assert result["same_params"]
    for seen in result["seen"]:
        assert all(b == 0 for b in seen["param_bytes"])
        assert seen["identical"]
        assert seen["nbytes"] > 0
        if expect_grads:
            assert seen["grad_bytes"] and all(b == 0 for b in seen["grad_bytes"])


def test_fsdp_state_round_trips_and_trains_identically():
    _check(_run("transformers"), expect_grads=False)


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="spawn joins gloo ranks; on a GPU machine the megatron backend's tensors need NCCL",
)
def test_megatron_state_parks_params_grad_buffers_and_optimizer():
    (result,) = spawn(_run, 1, "megatron")
    _check(result, expect_grads=True)


def test_moves_only_what_is_asked():
    state = _state("transformers")
    state, _ = _train(state, (1,))
    param_bytes = sum(p.untyped_storage().nbytes() for p in state.params.values())
    parked = tf.offload(state, params=True, grads=False, optimizer=False)
    assert parked.nbytes == param_bytes
    assert parked.kinds == ("params",)
    moments = [t for t in tf.pytree.tree_leaves(parked.state.opt_state) if t.numel() > 1]
    assert moments and all(t.untyped_storage().nbytes() > 0 for t in moments)
    tf.reload(parked)


def test_offloading_nothing_is_an_error():
    with pytest.raises(ValueError, match="at least one"):
        tf.offload(_state("transformers"), params=False, grads=False, optimizer=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device memory exists only on a GPU")
def test_gpu_memory_is_freed_and_restored():
    model = tf.models.from_hf_config(tiny_config("qwen2"), seed=0, device="cuda")
    state, _ = _train(tf.init(model, tf.optim.adamw(1e-2)), (1,))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    parked = tf.offload(state)
    assert before - torch.cuda.memory_allocated() >= parked.nbytes
    state = tf.reload(parked)
    assert torch.cuda.memory_allocated() == before
