"""`MegatronModel` on one process and on 2 gloo ranks (tp2, pp2): the class API trains like the
functional API on the megatron backend, steps after exactly N forward_backward calls, gives
TransformersModel's log-probs, saves and resumes across meshes and loads weights only. Its LoRA
adapter is ``test_class_api_megatron_lora.py``'s, its refusals
``test_class_api_megatron_errors.py``'s.

Two spawns (megatron-core takes seconds to import), the fixture ``runs`` of ``conftest.py``
(shared with the LoRA tests); the parent compares. Tolerances (float32:
megatron's distributed optimizer has no float64 path): losses and gradient norms agree to a
relative 1e-5 -- the same computation, ranks summing token losses in another order. A run saved
on tp2 and resumed on pp2 is held to the same 1e-5 against the uninterrupted one-process run.
A weights-only load is checked in bf16 (where megatron keeps separate fp32 main parameters) against
a model built from the same weights: the same computation, so bit-identical.
Per-token log-probs equal TransformersModel's at the same initial weights to 1e-5 absolute
(float32 rounding, observed < 1e-6).
"""

from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import twinkle_fn as tf
from twinkle import DeviceMesh
from twinkle.model import MegatronModel, TransformersModel
from twinkle_fn.backends.megatron import parallel
from twinkle_fn.data import pad_collate
from twinkle_fn.optim import megatron_optimizer
from twinkle_fn.testing import random_features, tiny_config

BATCH, GAS, STEPS, RTOL, LOGPS_ATOL = 4, 2, 2, 1e-5, 1e-5
RESUMED = 2  # steps after resuming from the checkpoint saved after STEPS
LR, MIN_LR, DECAY = 1e-2, 1e-3, 4
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
MESHES = {"one": {}, "tp2": {"tp_size": 2}, "pp2": {"pp_size": 2}}
LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
SEQ = 10


def _micro_batches():
    feats = random_features(BATCH * GAS * (STEPS + RESUMED), seed=3)
    return [feats[i : i + BATCH] for i in range(0, len(feats), BATCH)]


def _model(sizes, source=None, **kwargs):
    """A MegatronModel with the optimizer and schedule of every run here."""
    mesh = DeviceMesh.from_sizes(world_size=max([1, *sizes.values()]), **sizes)
    model = MegatronModel(
        **(source or {"config": tiny_config()}),
        device_mesh=mesh,
        **{"mixed_precision": "no", "seed": 0, **kwargs},
    )
    model.set_optimizer("default", lr=LR, weight_decay=0.01, clip_grad=1.0)
    model.set_lr_scheduler(
        "OptimizerParamScheduler",
        lr_decay_style="linear",
        lr_warmup_steps=0,
        lr_decay_steps=DECAY,
        min_lr=MIN_LR,
    )
    return model


def _train(model, micros, outs=None, **step_kwargs):
    """Upstream's example loop: forward_backward + clip_grad_and_step with accumulation.
    Returns each step's metrics and, per call, whether it stepped; appends each call's output
    to `outs` if given."""
    steps, stepped = [], []
    for micro in micros:
        out = model.forward_backward(inputs=micro)
        norm = model.clip_grad_and_step(max_grad_norm=1.0, **step_kwargs)
        stepped.append(norm is not None)
        if norm is not None:
            steps.append({**model.calculate_metric(), "call_loss": out["loss"]})
        if outs is not None:
            outs.append(out)
    return steps, stepped


def _initial_logps(model):
    """forward_only's logps of the first micro-batch, padded and packed (padding-free)."""
    micro = _micro_batches()[0]
    padded = model.forward_only(inputs=micro)
    model.set_processor("InputProcessor", padding_free=True)
    packed = model.forward_only(inputs=micro)
    model.set_processor("InputProcessor")
    return {"padded": padded["logps"], "packed": packed["logps"], "loss": padded["loss"]}


def _four_calls():
    """Upstream's four-call loop (clip_grad_norm, step, zero_grad, lr_step) on one process:
    each step's metrics and gradient norm."""
    model = _model(MESHES["one"])
    steps = []
    for micro in _micro_batches()[: STEPS * GAS]:
        model.forward_backward(inputs=micro)
        norm = model.clip_grad_norm(1.0, gradient_accumulation_steps=GAS)
        model.step(gradient_accumulation_steps=GAS)
        model.zero_grad(gradient_accumulation_steps=GAS)
        model.lr_step(gradient_accumulation_steps=GAS)
        if norm is not None:
            steps.append({**model.calculate_metric(), "norm": norm})
    parallel.destroy()
    return steps


def _error(call):
    try:
        call()
    except ValueError as e:
        return str(e)
    return None


def _class_api(sizes, save_to=None, **kwargs):
    """Trains STEPS steps; with `save_to`, saves the full checkpoint there (and tries an
    interval that skips). Returns the metrics, stepped flags, train configs, host bytes parked,
    the refusal of an adapter added after training, the initial log-probs (`_initial_logps`,
    and the first forward_backward's) and the save's return values."""
    model = _model(sizes, **kwargs)
    logps, outs = _initial_logps(model), []
    micros = _micro_batches()[: STEPS * GAS]
    steps, stepped = _train(model, micros, outs, gradient_accumulation_steps=GAS)
    logps["forward_backward"] = outs[0]["logps"]
    configs = model.get_train_configs()
    parked = 0 if model._parked is None else model._parked.nbytes  # held on the host now
    late = _error(lambda: model.add_adapter_to_model("late", LORA))
    saved = None
    if save_to is not None:
        full = model.save("full", output_dir=save_to, consumed_train_samples=BATCH * GAS * STEPS)
        skipped = model.save(output_dir=save_to, interval=4)  # 2 steps: not a multiple of 4
        saved = (full, skipped)
    parallel.destroy()
    return steps, stepped, configs, parked, late, logps, saved


def _functional():
    options = dict(RECOMPUTE)
    model = tf.models.from_hf_config(tiny_config(), seed=0, backend="megatron", options=options)
    lr = tf.schedules.megatron("linear", LR, MIN_LR, 0, DECAY)
    state = tf.init(model, megatron_optimizer(lr, clip_grad=1.0, weight_decay=0.01), seed=0)
    infos, micros = [], _micro_batches()
    for s in range(STEPS + RESUMED):
        grads = None
        for micro in micros[s * GAS : (s + 1) * GAS]:
            grads, _ = tf.fwd_bwd(state, pad_collate(micro, 0), accum=grads)
        state, info = tf.step(state, grads)
        infos.append({k: float(v) for k, v in info.items()})
    parallel.destroy()
    return infos


def _resumed(path):
    """A fresh pp2 model resumed from `path` (saved on tp2), trained RESUMED more steps."""
    model = _model(MESHES["pp2"])
    info = model.resume_from_checkpoint(path)
    steps, _ = _train(model, _micro_batches()[STEPS * GAS :], gradient_accumulation_steps=GAS)
    parallel.destroy()
    return info, steps


def _weights_only(path):
    """bf16 on pp2: a model of other random weights after a weights-only `load(path)`, and a
    model built from `path`'s weights, each trained one step: (weights after the load, each
    run's metrics and weights after the step)."""
    runs = {}
    for name, source in (("loaded", None), ("built", {"model_id": path})):
        model = _model(MESHES["pp2"], source, mixed_precision="bf16", seed=1)
        if source is None:
            model.load(path)
            at_load = model.get_state_dict()
        steps, _ = _train(model, _micro_batches()[:GAS], gradient_accumulation_steps=GAS)
        runs[name] = (steps, model.get_state_dict())
        parallel.destroy()
    return at_load, runs


def _ids():
    ids = torch.randint(1, 96, (2, SEQ), generator=torch.Generator().manual_seed(3))
    return ids, torch.arange(SEQ).expand(2, SEQ)


@torch.no_grad()
def _logits(model):
    """The Megatron model's logits of `_ids` on one process, ``[2, SEQ, vocab]``."""
    gpt = model.state.model.placement.module
    gpt.eval()
    logits = gpt(*_ids(), None)
    gpt.train()
    return logits[..., : model.state.model.config.vocab_size]


def _lora(model_dir, out_dir):
    """A LoRA adapter on the tiny model dir, trained STEPS steps (its group's accumulation
    steps) and saved; what changed, and the logits of the trained model."""
    model = _model({}, {"model_id": model_dir})
    model.add_adapter_to_model("default", LORA, gradient_accumulation_steps=GAS)
    model.set_optimizer("default", adapter_name="default", lr=LR)
    gpt = model.state.model.placement.module
    frozen = {n: p.detach().clone() for n, p in gpt.named_parameters() if not p.requires_grad}
    at_init = model.get_state_dict()
    steps, stepped = _train(model, _micro_batches()[: STEPS * GAS])
    frozen_changed = [
        n for n, p in gpt.named_parameters() if n in frozen and not p.equal(frozen[n])
    ]
    run = dict(
        steps=steps,
        stepped=stepped,
        at_init=at_init,
        trained=model.get_state_dict(adapter_name="default"),
        frozen=len(frozen),
        frozen_changed=frozen_changed,
        logits=_logits(model),
        path=model.save("adapter", output_dir=out_dir),
        resumable=_resumable(model, out_dir),
        errors=[
            _error(lambda: model.add_adapter_to_model("second", LORA)),
            _error(lambda: model.load("adapter", output_dir=out_dir)),
            _error(lambda: model.get_state_dict(adapter_name="other")),
        ],
    )
    parallel.destroy()
    return run


def _resumable(model, out_dir):
    """Save the adapter with its training state, train one more step, resume: the files, what
    resume returns, and whether the adapter is back to the saved one."""
    path = model.save("state", output_dir=out_dir, save_optimizer=True, consumed_train_samples=6)
    saved = model.get_state_dict(adapter_name="default")
    _train(model, _micro_batches()[:GAS])
    moved = model.get_state_dict(adapter_name="default")
    progress = model.resume_from_checkpoint(path)
    back = model.get_state_dict(adapter_name="default")
    return dict(
        files=sorted(p.name for p in Path(path).iterdir()),
        progress=progress,
        moved=any(not torch.equal(moved[k], saved[k]) for k in saved),
        back=all(torch.equal(back[k], saved[k]) for k in saved),
    )


OFFLOAD = dict(param_offload=True, grad_offload=True, optimizer_offload=True)


def _one_process(model_dir, out_dir):
    return (
        _functional(),
        _class_api(MESHES["one"]),
        _class_api(MESHES["one"], **OFFLOAD),
        _lora(model_dir, out_dir),
        _four_calls(),
    )


def _two_ranks(out_dir):
    runs = {"pp2": _class_api(MESHES["pp2"]), "tp2": _class_api(MESHES["tp2"], save_to=out_dir)}
    path = runs["tp2"][-1][0]
    runs["resumed"] = _resumed(path)
    runs["weights_only"] = _weights_only(path)
    return runs


@pytest.mark.parametrize("mesh", [*MESHES, "offload"])
def test_class_api_equals_functional_api(runs, mesh):
    reference, results, _ = runs
    for steps, stepped, _, parked, late, _, _ in results[mesh]:
        assert (parked > 0) == (mesh == "offload")
        assert stepped == [False, True] * STEPS  # exactly GAS calls per step, not one late
        assert len(steps) == STEPS
        for got, want in zip(steps, reference[:STEPS], strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=RTOL)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=RTOL)
            assert got["lr"] == pytest.approx(want["lr"], rel=1e-12)
            assert got["num_tokens"] == want["num_tokens"]
        assert "before the first forward_backward" in late
    assert [s["step"] for s in results[mesh][0][0]] == [1, 2]


@pytest.mark.parametrize("mesh", [*MESHES, "offload"])
def test_logps_equal_transformers_models(runs, mesh):
    """forward_only (padded and packed) and the first forward_backward give the per-token
    log-probs TransformersModel gives at the same initial weights, [n_seq, max_len]."""
    _, results, _ = runs
    want = {}
    for padding_free in (False, True):
        hf = TransformersModel(config=tiny_config(), mixed_precision="no", seed=0)
        hf.set_processor("InputProcessor", padding_free=padding_free)
        want[padding_free] = hf.forward_only(inputs=_micro_batches()[0])
    for *_, logps, _ in results[mesh]:
        for got, ref in (
            (logps["padded"], want[False].logps),
            (logps["packed"], want[True].logps),
            (logps["forward_backward"], want[False].logps),
        ):
            assert got.shape == ref.shape
            torch.testing.assert_close(got, ref, rtol=0, atol=LOGPS_ATOL)
        assert logps["loss"] == pytest.approx(want[False].loss, rel=RTOL)


def test_upstreams_four_call_loop_equals_clip_grad_and_step(runs):
    """clip_grad_norm makes megatron's update (its optimizer clips inside it); step, zero_grad
    and lr_step then find nothing pending: the same steps as the functional reference."""
    reference, _, extra = runs
    steps = extra["four_calls"]
    assert len(steps) == STEPS
    for got, want in zip(steps, reference[:STEPS], strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=RTOL)
        assert got["norm"] == pytest.approx(want["grad_norm"], rel=RTOL)
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-12)
    assert [s["step"] for s in steps] == [1, 2]


def test_train_configs_describe_the_megatron_setup(runs):
    _, results, _ = runs
    configs = results["tp2"][0][2]
    assert "MegatronDistributedOptimizer" in configs and "OptimizerParamScheduler" in configs
    assert "recompute_granularity" in configs


def test_saved_on_tp2_resumes_on_pp2_like_an_uninterrupted_run(runs):
    reference, results, extra = runs
    full, skipped = results["tp2"][0][-1]
    assert skipped is None and Path(full).name == "full"
    assert tf.checkpoint.is_complete(full)
    # Full HF weights at the top of the directory, as a plain transformers checkpoint.
    assert AutoModelForCausalLM.from_pretrained(full).config.num_hidden_layers == 2
    for info, steps in extra["resumed"]:
        assert info == {
            "cur_step": STEPS,
            "consumed_train_samples": BATCH * GAS * STEPS,
            "gradient_accumulation_steps": 1,  # the group's; the loop passed GAS per call
        }
        assert [s["step"] for s in steps] == list(range(STEPS + 1, STEPS + RESUMED + 1))
        for got, want in zip(steps, reference[STEPS:], strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=RTOL)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=RTOL)
            assert got["lr"] == pytest.approx(want["lr"], rel=1e-12)  # the schedule resumed


def test_weights_only_load_trains_from_the_loaded_weights(runs):
    _, results, extra = runs
    saved = load_file(Path(results["tp2"][0][-1][0]) / "model.safetensors")
    for at_load, by_source in extra["weights_only"]:
        assert at_load.keys() == saved.keys()
        for name, tensor in saved.items():
            assert torch.equal(at_load[name], tensor.to(torch.bfloat16)), name
        (loaded_steps, loaded), (built_steps, built) = by_source["loaded"], by_source["built"]
        assert loaded_steps == built_steps
        for name, tensor in built.items():
            assert torch.equal(loaded[name], tensor), name
        assert any(not torch.equal(built[n], at_load[n]) for n in built)  # the step moved them
