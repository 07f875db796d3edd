"""The megatron backend on real gloo ranks: every mesh trains like one process, and like the
transformers backend, from the same HF initialisation; so do the policy-gradient, PPO and DPO
losses. Training options and guards (accumulation, precisions, recompute, compiled layers,
grouped experts, plain transforms, overlapped gathers) are ``backend_options_test``'s.

Two spawned worlds keep the suite short (megatron-core takes seconds to import): one process
runs the references and the single-process checks, two processes run every mesh in turn (the
session fixtures ``one_process`` and ``two_ranks`` of ``conftest.py``, shared with
``backend_options_test``).

Tolerances (float32: megatron's distributed optimizer has no float64 path). Losses agree to a
relative 1e-5: the ranks sum the same token losses in another order (observed <= 3e-7).
Parameters after 3 AdamW steps agree to 2e-4 absolute, 2% of one step at lr 1e-2: Adam divides
each gradient by its own running scale, so an element whose gradient is almost zero moves by up
to lr on the sign of float32 rounding noise (observed <= 6e-5; <= 1e-4 for PPO, i.e. GRPO with
every option, on tp2, tp2+sp, cp2, pp2, dp2 and ep2, whose clipped terms cancel in many
gradients). The MoE model's rows run packed, as its reference: a padded batch sends its padding
tokens through the router and experts too, which regroups the float32 expert sums, and even on
one process GRPO's grad norm then drifts 2.3e-5 relative from the packed run's (params 1.1e-4),
past the 1e-5 above. Per-token log-probabilities
(`fwd_bwd`'s aux, `evaluate_logps`) of the initial weights agree with the HF model's
log-softmax at the labels to 1e-5 absolute (float32 rounding of the same sums).
"""

import functools

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers.core_model_loading import revert_weight_conversion

import twinkle_fn as tf
from twinkle_fn.backends.megatron import parallel
from twinkle_fn.backends.megatron.backend import evaluate_logps, megatron_optimizer
from twinkle_fn.backends.transformers.compute import model_inputs
from twinkle_fn.data import pack, pad_collate
from twinkle_fn.distributed import rank
from twinkle_fn.losses import token_logps
from twinkle_fn.testing import (
    no_host_sync,
    random_features,
    tiny_config,
    with_advantages,
    with_rl_fields,
)

STEPS = 3
LR = tf.schedules.megatron("linear", 1e-2, 1e-3, 0, 4)  # a new lr at every step
LOSS_RTOL, PARAM_ATOL, LOGPS_ATOL = 1e-5, 2e-4, 1e-5
CONFIGS = {
    "qwen2": {},
    "qwen2-tied": {"tie_word_embeddings": True},
    "qwen3_moe": {},
}
# name -> (model, mesh sizes, backend options, batch layout)
MESHES = {
    "tp2": ("qwen2", {"tp": 2}, {}, "packed"),
    "pp2": ("qwen2-tied", {"pp": 2}, {"num_micro_batches": 2}, "padded"),
    "dp2": ("qwen2", {"dp": 2}, {}, "packed"),
    "dp2-gather": ("qwen2", {"dp": 2}, {"overlap_param_gather": True}, "packed"),
    "tp2-sp": ("qwen2", {"tp": 2, "sequence_parallel": True}, {}, "packed"),
    "ep2": ("qwen3_moe", {"dp": 2, "ep": 2}, {}, "packed"),
    "tp2-ep2-sp": ("qwen3_moe", {"tp": 2, "ep": 2, "sequence_parallel": True}, {}, "packed"),
    # each expert split over the two ranks (megatron wants sequence parallelism with MoE + tp)
    "tp2-etp2-sp": ("qwen3_moe", {"tp": 2, "etp": 2, "sequence_parallel": True}, {}, "packed"),
    "cp2": ("qwen2", {"cp": 2}, {}, "padded"),
    "cp2-packed": ("qwen3_moe", {"cp": 2}, {}, "packed"),  # q/k norms, MoE, THD chunks
}
# Losses other than the default on qwen2: the policy gradient (per-token advantages, entropy
# bonus), PPO with every option on (asymmetric clip, k3 KL, entropy bonus, TIS cap,
# sequence-mean weights: five per-token fields split with their tokens), and DPO (the 8
# sequences of a step are 4 interleaved pairs; a pass without gradients linearises it).
PG = tf.losses.policy_gradient(entropy_coef=0.1)
PPO = tf.losses.ppo_loss(
    0.2, 0.28, beta=0.1, entropy_coef=0.01, tis_cap=1.5, aggregation="seq_mean_token_mean"
)
DPO = tf.losses.dpo_loss(0.5, label_smoothing=0.1)
LOSSES = {"pg": PG, "ppo": PPO, "dpo": DPO}
# name -> (model, mesh sizes, backend options, batch layout)
LOSS_MESHES = {
    # vocabulary padded to 128 (a multiple of 2 x 32): rank 0 holds ids 0-63, rank 1 ids 64-95
    "tp2": ("qwen2", {"tp": 2}, {"vocab_multiple": 32}, "packed"),
    "tp2-sp": ("qwen2", {"tp": 2, "sequence_parallel": True}, {"vocab_multiple": 32}, "packed"),
    "cp2": ("qwen2", {"cp": 2}, {}, "packed"),  # each packed sample's zigzag chunks, fields too
    "pp2": ("qwen2", {"pp": 2}, {"num_micro_batches": 2}, "padded"),  # fields reach stage 2
    "dp2": ("qwen2", {"dp": 2}, {}, "packed"),  # DPO: two pairs per rank, the mean over four
    "dp2-padded": ("qwen2", {"dp": 2}, {}, "padded"),
    "ep2": ("qwen3_moe", {"dp": 2, "ep": 2}, {}, "packed"),  # each rank half the experts
}
# (loss, mesh) pairs run on two ranks
LOSS_RUNS = [(loss, m) for loss in ("pg", "ppo") for m in ("tp2", "cp2", "pp2")]
# DPO's first pass too: its log-probs merged back from the cp chunks / broadcast from the last stage
LOSS_RUNS += [("dpo", m) for m in ("dp2", "cp2", "pp2")]
# the rest of the GRPO (PPO with every option) and DPO table
LOSS_RUNS += [("ppo", m) for m in ("dp2-padded", "tp2-sp", "ep2")]
LOSS_RUNS += [("dpo", m) for m in ("dp2-padded", "tp2", "tp2-sp", "ep2")]
# the models whose one-process runs are the references of LOSS_RUNS
LOSS_MODELS = sorted({LOSS_MESHES[m][0] for _, m in LOSS_RUNS})


BACKENDS = ("transformers", "megatron")


def _config(name):
    return tiny_config(name.split("-")[0], **CONFIGS[name])


def _model(name, backend, **kwargs):
    return tf.models.from_hf_config(_config(name), seed=0, backend=backend, **kwargs)


def _tx(backend):
    if backend == "megatron":
        return megatron_optimizer(LR, clip_grad=1.0, weight_decay=0.01)
    return tf.optim.chain(tf.optim.clip_by_global_norm(1.0), tf.optim.adamw(LR, weight_decay=0.01))


def _batch(feats, layout):
    return pack(feats) if layout == "packed" else pad_collate(feats, pad_token_id=0)


def _hf_names(params, name):
    """HF checkpoint names (one tensor per expert), as the megatron backend exports."""
    return revert_weight_conversion(AutoModelForCausalLM.from_config(_config(name)), params)


def _train(
    name,
    sizes=None,
    options=None,
    layout="packed",
    backend="megatron",
    tx=None,
    loss=None,
    **kw,
):
    """STEPS steps on this rank's slice of each global batch (a `loss` other than the default
    gets per-token advantages, or every field of `with_rl_fields` when it reads more, loss
    weights from the whole batch), then an evaluation of the whole first batch:
    ``({infos, params, eval}, state)``."""
    mesh = tf.Mesh(**(sizes or {}))
    state = tf.init(_model(name, backend, options=options, **kw), tx or _tx(backend), mesh)
    # The initial weights' log-probs of the whole first batch, and of this rank's slice.
    logps = {"slice": mesh.get_slice(8, rank())}
    if backend == "megatron":
        logps["eval"] = evaluate_logps(state, _batch(random_features(8, seed=100), layout))[1]
    infos = []
    for i in range(STEPS):
        feats = random_features(8, seed=100 + i)
        if loss is not None:
            fields = with_advantages if set(loss.fields) <= {"advantages"} else with_rl_fields
            feats = fields(feats, seed=i)
        mine = _batch(feats[mesh.get_slice(len(feats), rank())], layout)
        grads, aux = tf.fwd_bwd(state, mine, loss=loss)
        logps.setdefault("fwd_bwd", aux.get("logps"))
        state, info = tf.step(state, grads)
        infos.append({k: float("nan") if v is None else float(v) for k, v in info.items()})
    evaluated = tf.evaluate(state, _batch(random_features(8, seed=100), layout))
    run = dict(
        infos=infos,
        params=_hf_names(tf.unshard(state), name),
        eval=(float(evaluated.loss_sum), int(evaluated.num_tokens)),
        logps=logps,
    )
    if backend == "megatron":
        parallel.destroy()
    return run, state


def _own_process_group():
    """With no process group, tf.init on one process starts its own one-rank group."""
    dist.destroy_process_group()
    run, _ = _train("qwen2")
    return dist.get_world_size(), run


def _one_process():
    """The references (every model on both backends) and the single-process checks of
    ``backend_test`` and ``backend_options_test``: ``(refs, checks)``."""
    from twinkle_fn.backends.megatron.backend_options_test import (
        _accumulation,
        _adam_kernels,
        _compiled,
        _experts_classes,
        _misuse,
        _pending_scale,
        _precisions,
    )

    refs = {}
    for name in CONFIGS:
        for backend in BACKENDS:
            refs[name, backend], state = _train(name, backend=backend)
            if (name, backend) == ("qwen2", "megatron"):
                adam_kernels = _adam_kernels(state)
            if (name, backend) == ("qwen3_moe", "megatron"):
                default_experts = _experts_classes(state)
    looped, looped_state = _train("qwen3_moe", options={"grouped_experts": False})
    checks = dict(
        padded_micro=_train("qwen2", options={"num_micro_batches": 2}, layout="padded")[0],
        accumulation=_accumulation(),
        misuse=_misuse(),
        precisions=_precisions(),
        plain_transform=_train("qwen2", tx=_tx("transformers"))[0],
        pending_scale=_pending_scale(),
        compiled=_compiled(),
        adam_kernels=adam_kernels,
        experts=(default_experts, looped, _experts_classes(looped_state)),
        losses={
            (loss, b): _train("qwen2", backend=b, loss=LOSSES[loss])[0]
            for loss, b in (*((loss, "megatron") for loss in LOSSES), ("pg", "transformers"))
        }
        | {
            (loss, model): _train(model, loss=LOSSES[loss])[0]
            for loss in ("ppo", "dpo")
            for model in LOSS_MODELS
            if model != "qwen2"
        },
    )
    parallel.destroy()
    checks["own_group"] = _own_process_group()
    return refs, checks


def _two_ranks(weights_dir):
    """Every mesh and loss run of ``backend_test`` and the two-rank checks of
    ``backend_options_test`` in turn, then `weights_dir` read on tp2 + sp."""
    from twinkle_fn.backends.megatron.backend_options_test import _gathers_in_flight

    results = {}
    for name, (model, sizes, options, layout) in MESHES.items():
        results[name] = _train(model, sizes, options, layout)[0]
    for loss, name in LOSS_RUNS:
        model, sizes, options, layout = LOSS_MESHES[name]
        results[loss, name] = _train(model, sizes, options, layout, loss=LOSSES[loss])[0]
    # Context parallelism keeps whole parameters on every rank: a plain transform applies.
    results["cp2-plain-transform"] = _train("qwen2", {"cp": 2}, tx=_tx("transformers"))[0]
    results["gather-plain-transform"] = _train(
        "qwen2", {"dp": 2}, {"overlap_param_gather": True}, tx=_tx("transformers")
    )[0]
    results["in_flight"] = _gathers_in_flight()
    model = tf.models.from_pretrained(weights_dir, backend="megatron")
    state = tf.init(model, _tx("transformers"), tf.Mesh(tp=2, sequence_parallel=True))
    loaded = tf.unshard(state)
    grads, _ = tf.fwd_bwd(state, pack(random_features(2)))
    try:
        tf.step(state, grads)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return results, loaded, refused


@functools.cache
def _hf_logps(name, layout, start=0, stop=8):
    """The HF model's log-softmax at the labels, at the seed-0 initialisation both backends
    load, of features ``start:stop`` of the first batch in `layout`."""
    module = _model(name, "transformers").module.eval()
    batch = _batch(random_features(8, seed=100)[start:stop], layout)
    with torch.no_grad():
        logits = module(**model_inputs(batch, torch.device("cpu")), use_cache=False).logits
    return token_logps(logits, batch["labels"])


def _assert_logps(run, name, layout):
    """`run`'s log-probs (in the batch's own layout) equal the HF model's at the same weights."""
    logps, part = run["logps"], run["logps"]["slice"]
    want = _hf_logps(name, layout)
    assert logps["eval"].shape == want.shape
    torch.testing.assert_close(logps["eval"], want, rtol=0, atol=LOGPS_ATOL)
    torch.testing.assert_close(
        logps["fwd_bwd"], _hf_logps(name, layout, part.start, part.stop), rtol=0, atol=LOGPS_ATOL
    )


def _assert_same_losses(got, want, rtol=LOSS_RTOL):
    for info, ref in zip(got["infos"], want["infos"], strict=True):
        assert info["loss"] == pytest.approx(ref["loss"], rel=rtol)
        assert info["grad_norm"] == pytest.approx(ref["grad_norm"], rel=rtol)
        assert info["num_tokens"] == ref["num_tokens"]
        assert info["lr"] == pytest.approx(ref["lr"])
    assert got["eval"][0] == pytest.approx(want["eval"][0], rel=rtol)
    assert got["eval"][1] == want["eval"][1]
    assert got["params"].keys() == want["params"].keys()


def _assert_same_run(got, want):
    _assert_same_losses(got, want)
    for n, p in got["params"].items():
        torch.testing.assert_close(
            p, want["params"][n], rtol=0, atol=PARAM_ATOL, msg=lambda m, n=n: f"{n}: {m}"
        )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_process_matches_the_transformers_backend(one_process, name):
    refs, _ = one_process
    _assert_same_run(refs[name, "megatron"], refs[name, "transformers"])
    lrs = [i["lr"] for i in refs[name, "megatron"]["infos"]]
    assert lrs == pytest.approx([LR(i) for i in range(STEPS)])


@pytest.mark.parametrize("mesh", list(MESHES))
def test_mesh_matches_one_process_and_the_transformers_backend(one_process, two_ranks, mesh):
    refs, _ = one_process
    model, _, _, layout = MESHES[mesh]
    for results, _, _ in two_ranks[1]:  # every rank reports the same loss, norm and weights
        _assert_same_run(results[mesh], refs[model, "megatron"])
        _assert_same_run(results[mesh], refs[model, "transformers"])
        _assert_logps(results[mesh], model, layout)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logps_equal_the_hf_models_log_softmax(one_process, name):
    """Packed batches (one micro-batch) and padded ones (two) on one process."""
    _assert_logps(one_process[0][name, "megatron"], name, "packed")
    _assert_logps(one_process[1]["padded_micro"], "qwen2", "padded")


def test_a_token_loss_on_one_process_matches_the_transformers_backend(one_process):
    """The policy gradient only. PPO's three steps sit at the edge of `PARAM_ATOL`: float32
    rounding alone (the transformers backend against itself in float64) moves one up_proj
    element by 1.7e-4, the megatron backend by 2.6e-4 (a gradient of 2e-4 summed from terms
    that cancel, then divided by Adam's running scale). Each backend's PPO is pinned to its
    float64 reference instead (``token_terms_test``, ``transformers/ppo_test``)."""
    runs = one_process[1]["losses"]
    _assert_same_run(runs["pg", "megatron"], runs["pg", "transformers"])


@pytest.mark.parametrize(("loss", "mesh"), LOSS_RUNS)
def test_a_token_loss_on_a_mesh_matches_one_process(one_process, two_ranks, loss, mesh):
    model = LOSS_MESHES[mesh][0]
    want = one_process[1]["losses"][loss, "megatron" if model == "qwen2" else model]
    for results, _, _ in two_ranks[1]:
        _assert_same_run(results[loss, mesh], want)


def test_one_process_starts_its_own_process_group(one_process):
    world, run = one_process[1]["own_group"]
    assert world == 1
    _assert_same_run(run, one_process[0]["qwen2", "megatron"])


def test_from_pretrained_reads_each_rank_slices_exactly(two_ranks):
    weights_dir, per_rank = two_ranks
    want = _hf_names(
        dict(AutoModelForCausalLM.from_pretrained(weights_dir).state_dict()), "qwen3_moe"
    )
    for _, loaded, _ in per_rank:
        assert loaded.keys() == want.keys()
        assert all(torch.equal(loaded[n], want[n]) for n in want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL)")
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_a_training_step_on_cuda_never_syncs_the_host(layout):
    """fwd_bwd and step of a CPU batch queue all their work, the gradient clip included
    (`twinkle_fn.backends.megatron.multi_tensor`): the grad norm stays on the device. A packed row is
    rotated from each token's position (`twinkle_fn.backends.megatron.packed_rotary`; megatron's own
    THD rotation reads the sample bounds on the host in every layer) and attends on a varlen
    kernel."""
    model = tf.models.from_hf_config(
        tiny_config(), seed=0, backend="megatron", device="cuda", precision="bf16"
    )
    try:
        state = tf.init(model, megatron_optimizer(LR))
        batch = _batch(random_features(4, seed=1), layout)
        state, _ = tf.step(state, tf.fwd_bwd(state, batch)[0])  # warm-up: lazy inits may sync
        with no_host_sync():
            grads, _ = tf.fwd_bwd(state, batch)
            state, info = tf.step(state, grads)
        assert info["grad_norm"].is_cuda
        assert torch.isfinite(info["loss"]) and torch.isfinite(info["grad_norm"])
    finally:
        parallel.destroy()
        dist.destroy_process_group()
