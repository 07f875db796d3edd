"""`MegatronModel` on one process and on 2 gloo ranks (tp2, pp2): the class API trains like the
functional API on the megatron backend, steps after exactly N forward_backward calls, and
refuses what upstream's Megatron class refuses.

Two spawns (megatron-core takes seconds to import); the parent compares. Tolerances (float32:
megatron's distributed optimizer has no float64 path): losses and gradient norms agree to a
relative 1e-5 -- the same computation, ranks summing token losses in another order.
"""

import pytest

import twinkle_fn as tf
from twinkle import DeviceMesh
from twinkle.model import MegatronModel
from twinkle_fn.backends.megatron import megatron_optimizer
from twinkle_fn.data import pad_collate
from twinkle_fn.megatron import parallel
from twinkle_fn.testing import random_features, tiny_config
from twinkle_fn.testing_dist import spawn

BATCH, GAS, STEPS, RTOL = 4, 2, 2, 1e-5
LR, MIN_LR, DECAY = 1e-2, 1e-3, 4
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
MESHES = {"one": {}, "tp2": {"tp_size": 2}, "pp2": {"pp_size": 2}}


def _micro_batches():
    feats = random_features(BATCH * GAS * STEPS, seed=3)
    return [feats[i : i + BATCH] for i in range(0, len(feats), BATCH)]


def _class_api(sizes, **kwargs):
    """Upstream's example loop: forward_backward + clip_grad_and_step with accumulation.
    Returns each step's metrics and, per call, whether it stepped."""
    mesh = DeviceMesh.from_sizes(world_size=max([1, *sizes.values()]), **sizes)
    model = MegatronModel(
        config=tiny_config(), device_mesh=mesh, mixed_precision="no", seed=0, **kwargs
    )
    model.set_optimizer("default", lr=LR, weight_decay=0.01, clip_grad=1.0)
    model.set_lr_scheduler(
        "OptimizerParamScheduler",
        lr_decay_style="linear",
        lr_warmup_steps=0,
        lr_decay_steps=DECAY,
        min_lr=MIN_LR,
    )
    steps, stepped = [], []
    for micro in _micro_batches():
        out = model.forward_backward(inputs=micro)
        norm = model.clip_grad_and_step(max_grad_norm=1.0, gradient_accumulation_steps=GAS)
        stepped.append(norm is not None)
        if norm is not None:
            steps.append({**model.calculate_metric(), "call_loss": out["loss"]})
    configs = model.get_train_configs()
    parked = 0 if model._parked is None else model._parked.nbytes  # held on the host now
    parallel.destroy()
    return steps, stepped, configs, parked


def _functional():
    options = dict(RECOMPUTE)
    model = tf.models.from_hf_config(tiny_config(), seed=0, backend="megatron", options=options)
    lr = tf.schedules.megatron("linear", LR, MIN_LR, 0, DECAY)
    state = tf.init(model, megatron_optimizer(lr, clip_grad=1.0, weight_decay=0.01), seed=0)
    infos, micros = [], _micro_batches()
    for s in range(STEPS):
        grads = None
        for micro in micros[s * GAS : (s + 1) * GAS]:
            grads, _ = tf.fwd_bwd(state, pad_collate(micro, 0), accum=grads)
        state, info = tf.step(state, grads)
        infos.append({k: float(v) for k, v in info.items()})
    parallel.destroy()
    return infos


OFFLOAD = dict(param_offload=True, grad_offload=True, optimizer_offload=True)


def _one_process():
    return _functional(), _class_api(MESHES["one"]), _class_api(MESHES["one"], **OFFLOAD)


def _two_ranks():
    return {name: _class_api(sizes) for name, sizes in MESHES.items() if sizes}


@pytest.fixture(scope="module")
def runs():
    reference, one, offloaded = spawn(_one_process, 1, timeout_s=300)[0]
    two = spawn(_two_ranks, 2, timeout_s=300)
    return reference, {
        "one": [one],
        "offload": [offloaded],
        **{n: [r[n] for r in two] for n in two[0]},
    }


@pytest.mark.parametrize("mesh", [*MESHES, "offload"])
def test_class_api_equals_functional_api(runs, mesh):
    reference, results = runs
    for steps, stepped, _, parked in results[mesh]:
        assert (parked > 0) == (mesh == "offload")
        assert stepped == [False, True] * STEPS  # exactly GAS calls per step, not one late
        assert len(steps) == STEPS
        for got, want in zip(steps, reference, strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=RTOL)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=RTOL)
            assert got["lr"] == pytest.approx(want["lr"], rel=1e-12)
            assert got["num_tokens"] == want["num_tokens"]
    assert [s["step"] for s in results[mesh][0][0]] == [1, 2]


def test_train_configs_describe_the_megatron_setup(runs):
    _, results = runs
    configs = results["tp2"][0][2]
    assert "MegatronDistributedOptimizer" in configs and "OptimizerParamScheduler" in configs
    assert "recompute_granularity" in configs


@pytest.fixture(scope="module")
def model():
    return MegatronModel(config=tiny_config(), mixed_precision="no")


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: m.set_optimizer("AdamW", lr=1e-3), "'default', 'MegatronDistributedOptimizer'"),
        (
            lambda m: m.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1),
            "'default', 'OptimizerParamScheduler'",
        ),
        (lambda m: m.forward(inputs=random_features(2)), "forward and backward together"),
        (lambda m: m.calculate_loss(), "forward and backward together"),
        (lambda m: m.backward(), "forward and backward together"),
        (lambda m: m.save("ckpt"), "megatron checkpoints are not wired yet"),
        (lambda m: m.load("ckpt"), "megatron checkpoints are not wired yet"),
        (lambda m: m.set_optimizer("default", betas=(0.9, 0.9)), "not supported; known: lr"),
        (lambda m: m.clip_grad_and_step(max_grad_norm=0.5), "clip_grad=1.0"),
    ],
)
def test_bad_calls_raise_clear_errors(model, call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(model)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mixed_precision="fp8"), "mixed_precision must be one of"),
        (dict(ddp_config={"overlap_grad_reduce": True}), "overlap_grad_reduce=True"),
        (dict(config=None), "needs model_id"),
    ],
)
def test_unsupported_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MegatronModel(**{"config": tiny_config(), **kwargs})


def test_vpp_is_refused_by_the_device_mesh():
    with pytest.raises(ValueError, match="vpp_size=2"):
        DeviceMesh.from_sizes(world_size=2, pp_size=2, vpp_size=2)
