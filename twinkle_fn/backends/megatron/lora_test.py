"""LoRA on the megatron backend: only adapters train, every mesh trains like one process, and the
exported adapter loads in peft onto the HF model with the Megatron model's logits.

The one-process references run in the test process (`megatron_world`); two spawned gloo ranks
run tp2, tp2 with sequence parallelism, pp2 and dp2 in turn, then the dropout and refusal cases.
Each trained model's log-probs with its adapters off (``tf.token_logps(disable_lora=True)``) are
compared with those of the same model built without LoRA, on one process, tp2 and pp2.

Tolerances (float32). Logits of the same weights through megatron's linears and through peft's
agree to 1e-5 (observed 0: the same matmuls). Losses and grad norms of a mesh agree with one
process to a relative 1e-5 (the ranks sum the same terms in another order). Adapters after 3
AdamW steps at lr 1e-2 agree to 2e-4 absolute, as in `backends/megatron_test.py`: an element
whose gradient is almost zero moves by up to lr on the sign of float32 rounding noise. Log-probs
with the adapters off equal the model's without LoRA bit for bit on one process; on 2 ranks to 1e-6
absolute (observed 4.8e-7, one float32 ulp at |logp| ~ 4.6): megatron runs a frozen weight
through `linear_with_frozen_weight`, which its own docstring says is not bit-identical to the
trainable weight's linear.
"""

import os

import pytest
import torch
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from peft import LoraConfig, PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import twinkle_fn as tf
from twinkle_fn.backends.megatron import lora as mlora
from twinkle_fn.backends.megatron import parallel
from twinkle_fn.backends.megatron.backend import megatron_optimizer
from twinkle_fn.data import pack, pad_collate
from twinkle_fn.distributed import rank
from twinkle_fn.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX
from twinkle_fn.testing import random_features, tiny_config
from twinkle_fn.testing_dist import spawn

CFG = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}
RANDOM_B = {**CFG, "init_lora_weights": False}  # B starts random: the export is not trivial
DROPOUT = {**RANDOM_B, "lora_dropout": 0.1}  # B != 0: A gets a gradient at once
STEPS, LR, SEQ = 3, 1e-2, 10
LOGITS_ATOL, LOSS_RTOL, PARAM_ATOL, TRAINED_ATOL, BASE_ATOL = 1e-5, 1e-5, 2e-4, 1e-4, 1e-6
HF_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name -> (mesh sizes, backend options, batch layout)
MESHES = {
    "tp2": ({"tp": 2}, {}, "packed"),
    "tp2-sp": ({"tp": 2, "sequence_parallel": True}, {}, "packed"),
    "pp2": ({"pp": 2}, {"num_micro_batches": 2}, "padded"),
    "dp2": ({"dp": 2}, {}, "packed"),
}


def _hf_model():
    torch.manual_seed(0)  # the base weights of tf.models.from_hf_config(..., seed=0)
    return AutoModelForCausalLM.from_config(tiny_config("qwen2"), dtype=torch.float32).eval()


def _ids():
    ids = torch.randint(1, 96, (2, SEQ), generator=torch.Generator().manual_seed(3))
    return ids, torch.arange(SEQ).expand(2, SEQ)


@torch.no_grad()
def _logits(state):
    """The Megatron model's logits of `_ids` (one pipeline stage), ``[2, SEQ, vocab]``."""
    gpt = state.model.placement.module
    device = next(gpt.parameters()).device
    gpt.eval()
    logits = gpt(*(t.to(device) for t in _ids()), None)
    gpt.train()
    return gather_from_tensor_model_parallel_region(logits)[..., :96].cpu()


def _flat(infos):
    return [x for loss_and_norm in infos for x in loss_and_norm]


def _batch(feats, layout):
    return pack(feats) if layout == "packed" else pad_collate(feats, pad_token_id=0)


def _logps(state, layout, **kw):
    """``tf.token_logps`` of a fixed batch (the same on every rank), ``[B, T]``."""
    return tf.token_logps(state, _batch(random_features(4, seed=50), layout), **kw)["logps"]


def _no_lora_logps(sizes, options=None, layout="packed"):
    """`_logps` of the model `_run` builds, without LoRA, on the mesh of `sizes`."""
    model = tf.models.from_hf_config(
        tiny_config("qwen2"), seed=0, backend="megatron", options=options
    )
    logps = _logps(tf.init(model, megatron_optimizer(LR), tf.Mesh(**sizes)), layout)
    parallel.destroy()
    return logps


def _run(sizes, options=None, layout="packed", lora=CFG, steps=STEPS, adapter_dir=None, **kw):
    """`steps` steps of the LoRA model on this rank's slice of each global batch."""
    mesh = tf.Mesh(**sizes)
    model = tf.models.from_hf_config(
        tiny_config("qwen2"), seed=0, backend="megatron", options=options, **kw
    )
    state = tf.init(mlora.add_lora(model, lora), megatron_optimizer(LR), mesh)
    gpt, chunk = state.model.placement.module, state.model.placement.chunks[0]
    frozen = {n: p.detach().clone() for n, p in gpt.named_parameters() if not p.requires_grad}
    at_init = mlora.adapter_state_dict(state)
    infos = []
    for i in range(steps):
        feats = random_features(8, seed=100 + i)
        grads, _ = tf.fwd_bwd(state, _batch(feats[mesh.get_slice(len(feats), rank())], layout))
        state, info = tf.step(state, grads)
        infos.append((float(info["loss"]), float(info["grad_norm"])))
    names = {id(p): n for n, p in gpt.named_parameters()}
    run = dict(
        infos=infos,
        # adapters on, off, and on again (the switch must restore them)
        logps=[_logps(state, layout, disable_lora=off) for off in (False, True, False)],
        at_init=at_init,
        adapter=tf.unshard(state),
        logits=_logits(state) if mesh.pp == 1 else None,
        trainable=sorted(state.params),
        slots=sorted(state.opt_state.slots),
        buffered=sorted(names[id(p)] for b in chunk.buffers for p in b.params),
        frozen=len(frozen),
        frozen_changed=[
            n for n, p in gpt.named_parameters() if n in frozen and not torch.equal(p, frozen[n])
        ],
        frozen_grads=[
            n
            for n, p in gpt.named_parameters()
            if n in frozen and (p.grad is not None or hasattr(p, "main_grad"))
        ],
        # Factors every tp rank holds whole: they must stay identical across the tp ranks.
        replicated={
            n: p.detach().clone()
            for n, p in gpt.named_parameters()
            if p.requires_grad and not getattr(p, "tensor_model_parallel", False)
        },
    )
    if adapter_dir is not None:
        for _ in range(2):  # a second save replaces the first
            mlora.save_adapter(state, adapter_dir)
    parallel.destroy()
    return run


def _bf16_storage():
    """The dtypes a bf16 LoRA state stores: frozen parameters, the adapters the model computes
    with, and the distributed optimizer's main copies of them; and the model's parameter bytes."""
    model = tf.models.from_hf_config(
        tiny_config("qwen2"), seed=0, backend="megatron", precision="bf16"
    )
    state = tf.init(mlora.add_lora(model, CFG), megatron_optimizer(LR), tf.Mesh())
    gpt = state.model.placement.module
    frozen = [p for p in gpt.parameters() if not p.requires_grad]
    out = dict(
        frozen={p.dtype for p in frozen},
        frozen_elements=sum(p.numel() for p in frozen),
        frozen_bytes=sum(p.numel() * p.element_size() for p in frozen),
        adapters={p.dtype for p in state.params.values()},
        main={s["main_param"].dtype for s in state.opt_state.slots.values()},
        moments={s["exp_avg"].dtype for s in state.opt_state.slots.values()},
    )
    parallel.destroy()
    return out


@pytest.fixture(scope="module")
def one(megatron_world, tmp_path_factory):
    """The one-process references, trained (and saved) and with a random B at init."""
    root = tmp_path_factory.mktemp("one")
    return dict(
        trained=_run({}, adapter_dir=root / "trained"),
        random_b=_run({}, lora=RANDOM_B, steps=0, adapter_dir=root / "random_b"),
        recompute=_run({}, activation_checkpointing=True),
        no_lora=_no_lora_logps({}),
        bf16=_bf16_storage(),
        dirs={"trained": root / "trained", "random_b": root / "random_b"},
        root=root,
    )


def _refusal(sizes, lora):
    try:
        _run(sizes, lora=lora, steps=0)
    except ValueError as e:
        parallel.destroy()
        return str(e)
    return None


def _two_ranks():
    runs = {name: _run(*spec) for name, spec in MESHES.items()}
    runs["no_lora_tp2"] = _no_lora_logps(*MESHES["tp2"])
    runs["no_lora_pp2"] = _no_lora_logps(*MESHES["pp2"])
    runs["random_b"] = _run({"tp": 2}, lora=RANDOM_B, steps=0)
    for name, sizes in (
        ("dropout", {"tp": 2}),
        ("dropout-sp", {"tp": 2, "sequence_parallel": True}),
    ):
        runs[name] = _run(sizes, lora=DROPOUT, steps=1)
    runs["refused"] = _refusal(
        {"pp": 2}, {**CFG, "target_modules": HF_LINEARS, "layers_to_transform": [0]}
    )
    return runs


@pytest.fixture(scope="module")
def two():
    return spawn(_two_ranks, 2, timeout_s=300)


def test_only_adapters_train_and_base_weights_stay_bit_identical(one):
    run = one["trained"]
    # 2 layers x (linear_qkv, linear_proj, linear_fc1, linear_fc2) x (A, B)
    assert len(run["trainable"]) == 16
    assert all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in run["trainable"])
    # The state, megatron's optimizer and its DDP grad buffers hold the adapters and nothing else.
    assert run["slots"] == run["buffered"] == run["trainable"]
    assert run["frozen"] > 0 and run["frozen_changed"] == [] and run["frozen_grads"] == []
    assert len(run["infos"]) == STEPS and all(norm > 0 for _, norm in run["infos"])
    moved = [n for n, t in run["adapter"].items() if not torch.equal(t, run["at_init"][n])]
    assert len(moved) == len(run["adapter"])
    assert sorted(os.listdir(one["root"])) == ["random_b", "trained"]  # no temporary left


def test_bf16_stores_frozen_weights_in_bf16_and_keeps_float32_masters(one):
    """Float16Module casts the whole stage to bf16; only the trained adapters get float32
    main parameters (and moments) in the distributed optimizer."""
    bf16 = one["bf16"]
    assert bf16["frozen"] == {torch.bfloat16}
    assert bf16["frozen_bytes"] == 2 * bf16["frozen_elements"]
    assert bf16["adapters"] == {torch.bfloat16}
    assert bf16["main"] == bf16["moments"] == {torch.float32}


@pytest.mark.parametrize("name", ["trained", "random_b"])
def test_saved_adapter_loads_in_peft_with_the_megatron_logits(one, name):
    path = one["dirs"][name]
    assert sorted(os.listdir(path)) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    weights = load_file(path / ADAPTER_WEIGHTS)
    assert len(weights) == 2 * len(HF_LINEARS) * 2
    assert weights.keys() == one[name]["adapter"].keys()
    assert all(k.startswith(PEFT_PREFIX + "model.layers.") for k in weights)
    assert set(LoraConfig.from_pretrained(path).target_modules) == set(HF_LINEARS)
    peft_model = PeftModel.from_pretrained(_hf_model(), path).eval()
    ids, _ = _ids()
    with torch.no_grad():
        logits = peft_model(input_ids=ids).logits
        with peft_model.disable_adapter():
            base = peft_model(input_ids=ids).logits
    torch.testing.assert_close(logits, one[name]["logits"], rtol=0, atol=LOGITS_ATOL)
    assert (logits - base).abs().max() > 1e-2  # the adapter was applied, not skipped


def test_disable_lora_gives_the_logps_of_the_model_without_lora(one, two):
    """Adapters trained 3 steps (B != 0) change the log-probs; switched off they give the
    model's without LoRA (bit for bit on one process, to `BASE_ATOL` on tp2 and pp2: every
    stage switches its own), and switched back on they give the adapted ones again."""
    assert torch.equal(one["trained"]["logps"][1], one["no_lora"])
    for run, no_lora in [(one["trained"], one["no_lora"])] + [
        (runs[mesh], runs[f"no_lora_{mesh}"]) for runs in two for mesh in ("tp2", "pp2")
    ]:
        adapted, base, again = run["logps"]
        assert (adapted - base).abs().max() > 1e-3
        torch.testing.assert_close(base, no_lora, rtol=0, atol=BASE_ATOL)
        assert torch.equal(again, adapted)


def test_recompute_trains_the_adapters_like_no_recompute(one):
    """Full recompute with a frozen embedding: the layers still backpropagate into adapters."""
    run, ref = one["recompute"], one["trained"]
    assert _flat(run["infos"]) == pytest.approx(_flat(ref["infos"]), rel=LOSS_RTOL)
    for n, t in run["adapter"].items():
        torch.testing.assert_close(t, ref["adapter"][n], rtol=0, atol=PARAM_ATOL)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_mesh_matches_one_process(one, two, mesh):
    ref, pp = one["trained"], MESHES[mesh][0].get("pp", 1)
    # dp2: each data rank's distributed optimizer holds the adapters it owns a part of.
    mine = (set(runs[mesh]["slots"]) <= set(runs[mesh]["trainable"]) for runs in two)
    assert all(mine)
    slots = set().union(*(runs[mesh]["slots"] for runs in two))
    assert slots == set().union(*(runs[mesh]["trainable"] for runs in two))
    for runs in two:
        run = runs[mesh]
        assert run["buffered"] == run["trainable"] and len(run["trainable"]) == 16 // pp
        assert run["frozen_changed"] == [] and run["frozen_grads"] == []
        # The adapter starts the same on every mesh, then trains the same.
        assert all(torch.equal(t, ref["at_init"][n]) for n, t in run["at_init"].items())
        for (loss, norm), (ref_loss, ref_norm) in zip(run["infos"], ref["infos"], strict=True):
            assert loss == pytest.approx(ref_loss, rel=LOSS_RTOL)
            assert norm == pytest.approx(ref_norm, rel=LOSS_RTOL)
        assert run["adapter"].keys() == ref["adapter"].keys()
        for n, t in run["adapter"].items():
            torch.testing.assert_close(t, ref["adapter"][n], rtol=0, atol=PARAM_ATOL, msg=n)
        if run["logits"] is not None:  # the trained adapters' differences, ~1e-6, move them
            torch.testing.assert_close(run["logits"], ref["logits"], rtol=0, atol=TRAINED_ATOL)


def test_random_init_exports_the_same_adapter_on_tp2(one, two):
    """A random B goes through the fused q/k/v interleave and the per-rank [gate; up] split:
    the tp2 export is bit-identical to one process's, and so are its logits within fp32."""
    ref = one["random_b"]
    for runs in two:
        run = runs["random_b"]
        assert run["adapter"].keys() == ref["adapter"].keys()
        assert all(torch.equal(t, ref["adapter"][n]) for n, t in run["adapter"].items())
        torch.testing.assert_close(run["logits"], ref["logits"], rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("name", ["dropout", "dropout-sp"])
def test_factors_replicated_over_tp_stay_identical_under_dropout(two, name):
    first, second = (runs[name] for runs in two)
    assert len(first["replicated"]) == 8  # A of qkv and fc1, B of proj and fc2, per layer
    for n, t in first["replicated"].items():
        assert torch.equal(t, second["replicated"][n]), n
    assert first["infos"] == second["infos"]


def test_a_pipeline_stage_without_adapters_is_refused(two):
    for runs in two:
        assert "pipeline stage 1 (layers 1..1) has no adapter" in runs["refused"]


def test_add_lora_refuses_misuse():
    model = tf.models.from_hf_config(tiny_config("qwen2"), seed=0, backend="megatron")
    with pytest.raises(TypeError, match="LoraConfig or a dict"):
        mlora.add_lora(model, ["q_proj"])
    with_lora = mlora.add_lora(model, CFG)
    assert isinstance(with_lora.options["lora"], LoraConfig) and "lora" not in model.options
    with pytest.raises(ValueError, match="already has a LoRA config"):
        mlora.add_lora(with_lora, CFG)
    fsdp = tf.models.from_hf_config(tiny_config("qwen2"), seed=0)
    with pytest.raises(ValueError, match=r"use twinkle_fn\.lora\.add_lora"):
        mlora.add_lora(fsdp, CFG)
