"""The megatron backend's training options and guards, checked in the spawned worlds of
``backend_test`` (the session fixtures ``one_process`` and ``two_ranks`` of ``conftest.py``)
against its one-process runs: accumulated calls and micro-batches equal one batch, stale or
copied gradients are refused, bf16 / fp16 track fp32 (an fp16 overflow skips the update), full
recompute and compiled layers change nothing, grouped experts train as megatron's looped ones,
megatron's torch Adam steps with the fused kernel, a plain transform runs on whole parameters,
and overlapped parameter gathers are waited for by every reader. Tolerances are
``backend_test``'s.
"""

import math

import pytest
import torch

import twinkle_fn as tf
from twinkle_fn.backends.megatron import parallel, param_sync
from twinkle_fn.backends.megatron.backend import megatron_optimizer
from twinkle_fn.backends.megatron.backend_test import (
    LOSS_RTOL,
    LR,
    PARAM_ATOL,
    _assert_same_losses,
    _assert_same_run,
    _hf_names,
    _model,
    _train,
    _tx,
)
from twinkle_fn.backends.megatron.optimizer import _torch_adams
from twinkle_fn.backends.megatron.placement import model_placement
from twinkle_fn.data import pack
from twinkle_fn.distributed import rank
from twinkle_fn.testing import random_features

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_CLIP = 1.25  # `_pending_scale`'s clip threshold


def _accumulation():
    """Two fwd_bwd calls with accum, or one call with two megatron micro-batches, == one call."""
    feats = random_features(8, seed=7)
    out = {}
    for how in ("whole", "accum", "micro"):
        options = {"num_micro_batches": 2} if how == "micro" else None
        state = tf.init(_model("qwen2", "megatron", options=options), _tx("megatron"))
        if how == "accum":
            grads, _ = tf.fwd_bwd(state, pack(feats[:3]))
            grads, _ = tf.fwd_bwd(state, pack(feats[3:]), accum=grads)
        else:
            grads, _ = tf.fwd_bwd(state, pack(feats))
        shapes = {n: g.shape == state.params[n].shape for n, g in grads.params.items()}
        micro = grads.num_micro_batches
        state, info = tf.step(state, grads)
        out[how] = (float(info["loss"]), tf.unshard(state), all(shapes.values()), micro)
    return out


def _pending_scale():
    """A plain transform whose members take the token normalisation pending (clip, AdamW) and
    the same one hiding that (multiplied first): ``(pending run, multiplied-first run)``. An eps
    near the gradients' size makes AdamW's update depend on their scale, and the clip threshold
    lies among the steps' norms (1.20-1.27), so that it acts on some steps and not on others."""
    tx = tf.optim.chain(tf.optim.clip_by_global_norm(_CLIP), tf.optim.adamw(1e-2, eps=1e-3))
    return tuple(_train("qwen2", tx=tx._replace(takes_scaled=t))[0] for t in (True, False))


def _misuse():
    """Stale or copied gradients and direct updates are refused (the last call donates)."""
    errors = {}
    state = tf.init(_model("qwen2", "megatron"), _tx("megatron"))
    first, _ = tf.fwd_bwd(state, pack(random_features(2, seed=1)))
    second, _ = tf.fwd_bwd(state, pack(random_features(2, seed=2)))
    for what, call in (
        ("copied accum", lambda: tf.fwd_bwd(state, pack(random_features(2)), second, donate=False)),
        ("transform update", lambda: state.tx.update(second.params, state.opt_state)),
        ("stale step", lambda: tf.step(state, first)),
    ):
        try:
            call()
        except (ValueError, TypeError) as e:
            errors[what] = str(e)
    return errors


def _precisions():
    """bf16 and fp16 (constant loss scale) runs, an fp16 overflow, full recompute."""
    bf16, state = _train("qwen2", precision="bf16")
    master = next(iter(state.opt_state.slots.values()))["main_param"].dtype
    fp16, _ = _train("qwen2", precision="fp16", tx=megatron_optimizer(LR, loss_scale=128.0))
    recompute, _ = _train("qwen2", activation_checkpointing=True)
    state = tf.init(_model("qwen2", "megatron", precision="fp16"), megatron_optimizer(LR))
    state, overflow = tf.step(state, tf.fwd_bwd(state, pack(random_features(8)))[0])
    skipped = (float(overflow["grad_norm"]), overflow["lr"], int(state.opt_state.count))
    parallel.destroy()
    return dict(bf16=bf16, master=master, fp16=fp16, recompute=recompute, overflow=skipped)


def _compiled():
    """A run with every decoder layer compiled (dynamo's eager backend: the same kernels)."""
    run, state = _train("qwen2", options={"compile_layers": {"backend": "eager"}})
    layers = state.model.placement.module.decoder.layers
    return run, [layer._compiled_call_impl is not None for layer in layers]


def _experts_classes(state) -> set[str]:
    """The class names of the MoE layers' experts of a trained megatron state."""
    layers = state.model.placement.module.decoder.layers
    return {type(layer.mlp.experts).__name__ for layer in layers if hasattr(layer.mlp, "experts")}


def _adam_kernels(state):
    """Per torch Adam param group of a trained megatron state: (fused, foreach, step on the
    params' device)."""
    out = []
    for adam in _torch_adams(state.opt_state.optimizer):
        for group in adam.param_groups:
            on_device = all(adam.state[p]["step"].device == p.device for p in group["params"])
            out.append((group["fused"], group["foreach"], on_device))
    return out


def _gathers_in_flight():
    """Parameter all-gathers in flight with ``overlap_param_gather``: after a step, after the
    next forward, after a step and ``unshard``, after a step and ``offload``."""
    mesh = tf.Mesh(dp=2)
    model = _model("qwen2", "megatron", options={"overlap_param_gather": True})
    state = tf.init(model, _tx("megatron"), mesh)
    chunks = model_placement(state.model).chunks
    feats = random_features(8, seed=5)[mesh.get_slice(8, rank())]
    counts = []
    for read in ("forward", "unshard", "offload"):
        state, _ = tf.step(state, tf.fwd_bwd(state, pack(feats))[0])
        counts.append(param_sync.in_flight(chunks))
        if read == "forward":
            tf.evaluate(state, pack(feats))
        elif read == "unshard":
            tf.unshard(state)
        else:
            state = tf.reload(tf.offload(state))
        counts.append(param_sync.in_flight(chunks))
    parallel.destroy()
    return counts


def test_accumulated_calls_and_micro_batches_equal_one_batch(one_process):
    out = one_process[1]["accumulation"]
    whole_loss, whole, shaped, micro = out["whole"]
    assert shaped and micro == 1
    assert out["accum"][3] == 2 and out["micro"][3] == 2
    for how in ("accum", "micro"):
        loss, params, _, _ = out[how]
        assert loss == pytest.approx(whole_loss, rel=LOSS_RTOL)
        for n, p in params.items():
            torch.testing.assert_close(p, whole[n], rtol=0, atol=PARAM_ATOL, msg=n)


def test_stale_or_copied_gradients_and_direct_updates_are_refused(one_process):
    errors = one_process[1]["misuse"]
    assert "no longer own megatron's grad buffers" in errors["stale step"]
    assert "no longer own megatron's grad buffers" in errors["copied accum"]
    assert "applied by the megatron backend's tf.step" in errors["transform update"]


@pytest.mark.parametrize(("precision", "bound"), [("bf16", 0.15), ("fp16", 0.05)])
def test_mixed_precision_tracks_fp32(one_process, precision, bound):
    """bf16 (8 significant bits) and fp16 (11) compute over fp32 master weights. Losses stay
    within 2e-2 relative of fp32 (observed 2e-4). Weights are compared by their whole update:
    Adam turns the rounding noise of near-zero gradients into full steps, and the exported
    weights are the model's bf16 / fp16 copies, so single elements (and tiny tensors such as
    a k_proj bias) may differ by a step; the update as a whole differs from fp32's by 8% (bf16)
    and 2% (fp16) of its norm."""
    out, fp32 = one_process[1]["precisions"], one_process[0]["qwen2", "megatron"]
    assert out["master"] == torch.float32
    assert all(p.dtype == _DTYPES[precision] for p in out[precision]["params"].values())
    _assert_same_losses(out[precision], fp32, rtol=2e-2)
    init = _hf_names(dict(_model("qwen2", "transformers").module.state_dict()), "qwen2")
    got, want = out[precision]["params"], fp32["params"]
    error = sum(((got[n].float() - want[n]) ** 2).sum() for n in init) ** 0.5
    update = sum(((want[n] - init[n]) ** 2).sum() for n in init) ** 0.5
    assert error < bound * update


def test_full_recompute_changes_nothing(one_process):
    _assert_same_run(one_process[1]["precisions"]["recompute"], one_process[0]["qwen2", "megatron"])


def test_compiled_layers_change_nothing(one_process):
    run, compiled = one_process[1]["compiled"]
    assert compiled and all(compiled)
    _assert_same_run(run, one_process[0]["qwen2", "megatron"])


def test_grouped_experts_train_as_megatrons_looped_experts(one_process):
    """Grouped GEMMs by default; ``grouped_experts=False`` (megatron's ``SequentialMLP``) gives
    the same three steps: float32, the same products summed in another order."""
    default, looped, looped_classes = one_process[1]["experts"]
    assert default == {"GroupedSequentialMLP"} and looped_classes == {"SequentialMLP"}
    _assert_same_run(looped, one_process[0]["qwen3_moe", "megatron"])


def test_megatrons_torch_adam_steps_with_the_fused_kernel(one_process):
    kernels = one_process[1]["adam_kernels"]
    assert kernels and all(k == (True, False, True) for k in kernels)


def test_an_fp16_overflow_skips_the_update(one_process):
    grad_norm, lr, count = one_process[1]["precisions"]["overflow"]  # loss scale 2**32
    assert math.isnan(grad_norm) and lr is None and count == 0


def test_a_plain_transform_runs_on_whole_parameters(one_process, two_ranks):
    _assert_same_run(one_process[1]["plain_transform"], one_process[0]["qwen2", "transformers"])
    for results, _, refused in two_ranks[1]:
        assert "needs whole parameters on every rank" in refused
        _assert_same_run(results["cp2-plain-transform"], one_process[1]["plain_transform"])


def test_a_pending_token_scale_trains_as_multiplying_first(one_process):
    """The plain transform's step with the division by the tokens pending until AdamW reads each
    gradient equals the one that multiplies first (float32 rounding: the norm is the unscaled
    gradients' times the factor)."""
    pending, first = one_process[1]["pending_scale"]
    norms = [[info["grad_norm"] for info in run["infos"]] for run in (pending, first)]
    assert min(norms[1]) < _CLIP < max(norms[1]), "the clip should act on some steps only"
    torch.testing.assert_close(norms[0], norms[1], rtol=1e-5, atol=0)
    for n, p in pending["params"].items():
        torch.testing.assert_close(p, first["params"][n], rtol=1e-5, atol=1e-6, msg=n)


def test_overlapped_parameter_gathers_are_waited_for_by_every_reader(one_process, two_ranks):
    # One bucket group on this model: in flight after each step, settled by each reader.
    for results, _, _ in two_ranks[1]:
        assert results["in_flight"] == [1, 0, 1, 0, 1, 0]
        # a plain transform updates whole parameters on every rank: nothing to gather
        _assert_same_run(results["gather-plain-transform"], one_process[1]["plain_transform"])
