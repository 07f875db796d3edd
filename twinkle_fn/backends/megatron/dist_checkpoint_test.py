"""Checkpoints of megatron states (`tf.checkpoint.save` / `load` through dist_checkpointing):
exact round trips on the same mesh and across tp2 -> pp2, tp2 -> dp2 and (MoE) dp2 x ep2 ->
pp2, RNG states restored only on the same mesh, the fp16 grad scaler restored, LoRA states
resumed, and the HF export loads in transformers with the Megatron model's logits. Failed saves
and refused loads are ``dist_checkpoint_refusal_test``'s.

Two spawned gloo ranks run every mesh in turn (megatron-core takes seconds to import), the
refusals' cases too: the session fixture ``runs`` of ``conftest.py``. The model
is the tied-embedding qwen2 (on pp2 the last stage holds its own copy of the embedding, loaded
from the embedding's tensors, and the embedding has a grad bucket of its own), float32.

Tolerances. Save -> load is exact: the weights, and every tensor of a checkpoint re-saved at
once on another mesh, are bit-identical. Resumed on the same mesh, training is bit-identical to
the run that never saved. Resumed on another mesh, it is compared with a run that never saved
on that mesh: both went through two steps on different meshes first, so losses agree to a
relative 1e-5 and weights after two more AdamW steps to 2e-4 absolute, the tolerances of
`backends/megatron_test.py` (observed 1.1e-7 and 2e-6). Logits of the exported weights in
transformers and in megatron agree to 1e-5 (observed 1.4e-7), as in `model_test.py`.
"""

import copy

import pytest
import torch
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.core_model_loading import revert_weight_conversion

import twinkle_fn as tf
from twinkle_fn.backends.megatron import dist_checkpoint, parallel
from twinkle_fn.backends.megatron import lora as mlora
from twinkle_fn.backends.megatron.backend import megatron_optimizer
from twinkle_fn.data import pack
from twinkle_fn.distributed import rank
from twinkle_fn.testing import random_features, tiny_config

LR = tf.schedules.megatron("linear", 1e-2, 1e-3, 0, 4)  # a new lr at every step
LOSS_RTOL, PARAM_ATOL, LOGITS_ATOL = 1e-5, 2e-4, 1e-5
SEQ = 10
CONFIG = tiny_config("qwen2", tie_word_embeddings=True)
MOE_CONFIG = tiny_config("qwen3_moe")
LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "init_lora_weights": False}


def _state(sizes, seed=0, tx=None, lora=None, config=CONFIG, **kw):
    mesh = tf.Mesh(**sizes)
    options = {"num_micro_batches": 2} if mesh.pp > 1 else None
    model = tf.models.from_hf_config(config, seed=seed, backend="megatron", options=options, **kw)
    if lora is not None:
        model = mlora.add_lora(model, lora)
    return tf.init(model, tx or megatron_optimizer(LR, weight_decay=0.01), mesh)


def _steps(state, first, n):
    """`n` steps on this rank's slices of batches `first`, `first + 1`, ...: (state, losses)."""
    losses = []
    for i in range(first, first + n):
        feats = random_features(8, seed=100 + i)
        grads, _ = tf.fwd_bwd(state, pack(feats[state.mesh.get_slice(8, rank())]))
        state, info = tf.step(state, grads)
        losses.append(float(info["loss"]))
    return state, losses


def _rng():
    """This rank's CPU RNG state and megatron's tracked states."""
    tracked = tensor_parallel.get_cuda_rng_tracker().get_states()
    return torch.get_rng_state(), {k: v.clone() for k, v in tracked.items()}


def _advance_rng():
    """Draw from every RNG stream, so that restored states differ from fresh ones."""
    torch.rand(3)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        torch.rand(3)


def _same_rng(a, b):
    return (
        torch.equal(a[0], b[0])
        and a[1].keys() == b[1].keys()
        and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    )


@torch.no_grad()
def _logits(state):
    """The Megatron model's logits of fixed ids (tp only, no pp), ``[2, SEQ, vocab]``."""
    gpt = state.model.placement.module
    ids = torch.randint(1, CONFIG.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3))
    gpt.eval()
    logits = gpt(ids, torch.arange(SEQ).expand(2, SEQ), None)
    gpt.train()
    return ids, gather_from_tensor_model_parallel_region(logits)[..., : CONFIG.vocab_size]


def _scaler(state):
    return state.opt_state.optimizer.chained_optimizers[0].grad_scaler.state_dict()


def _fp16(root):
    """fp16 whose first step overflowed (loss scale 2**32): the grad scaler's state (scale,
    hysteresis) and the skipped update (step 1, count 0) round-trip."""
    tx = megatron_optimizer(LR, initial_loss_scale=2.0**32)
    state, _ = _steps(_state({"dp": 2}, tx=tx, precision="fp16"), 0, 1)
    saved = copy.deepcopy(_scaler(state))
    tf.checkpoint.save(state, root / "fp16")
    fresh = _state({"dp": 2}, tx=tx, precision="fp16")
    initial = copy.deepcopy(_scaler(fresh))
    loaded = tf.checkpoint.load(fresh, root / "fp16")
    return saved, initial, _scaler(loaded), (int(loaded.step), int(loaded.opt_state.count))


def _plain(path):
    """Every tensor of a checkpoint's dist checkpoint, whole, by dotted key (a collective; the
    common state's other values, such as the mesh, are left out)."""
    nested = dist_checkpointing.load_plain_tensors(str(path / dist_checkpoint.DIST_DIR))

    def flat(tree, prefix):
        items = tree.items() if isinstance(tree, dict) else enumerate(tree)
        for k, v in items:
            nested = isinstance(v, dict | list)
            yield from flat(v, f"{prefix}{k}.") if nested else [(f"{prefix}{k}", v)]

    return {k: v for k, v in flat(nested, "") if isinstance(v, torch.Tensor)}


def _same_rows(a, b):
    """Equal; a vocabulary tensor is padded per tp rank (to 256 rows on tp2, 128 on pp2), so
    only its real rows are compared."""
    if a.shape != b.shape:
        a, b = a[: CONFIG.vocab_size], b[: CONFIG.vocab_size]
    return torch.equal(a, b)


def _moe(root):
    """An MoE model saved on dp2 x ep2 (experts split over ranks, their optimizer a second
    chained optimizer) and loaded on pp2 (experts whole, one optimizer)."""
    state, _ = _steps(_state({"dp": 2, "ep": 2}, config=MOE_CONFIG), 0, 1)
    saved = tf.unshard(state)
    tf.checkpoint.save(state, root / "moe")
    parallel.destroy()
    state = tf.checkpoint.load(_state({"pp": 2}, seed=1, config=MOE_CONFIG), root / "moe")
    loaded = tf.unshard(state)
    parallel.destroy()
    return saved, loaded


def _lora(root):
    """A LoRA state saved on tp2 (its adapters and their optimizer state only), resumed on tp2
    (training goes on bit-identically) and loaded on pp2 (the same adapter), each into a fresh
    state of the same base model (whose adapters start at their initial values)."""
    out = {}
    state, _ = _steps(_state({"tp": 2}, lora=LORA), 0, 2)
    out["adapter"] = mlora.adapter_state_dict(state)
    tf.checkpoint.save(state, root / "lora")
    out["files"] = sorted(p.name for p in (root / "lora").iterdir())
    state, out["straight"] = _steps(state, 2, 2)
    out["straight_adapter"] = mlora.adapter_state_dict(state)
    parallel.destroy()
    # the base weights are the model's (not in the checkpoint): the same seed builds them
    state = tf.checkpoint.load(_state({"tp": 2}, lora=LORA), root / "lora")
    out["step"] = int(state.step)
    state, out["resumed"] = _steps(state, 2, 2)
    out["resumed_adapter"] = mlora.adapter_state_dict(state)
    parallel.destroy()
    state = tf.checkpoint.load(_state({"pp": 2}, lora=LORA), root / "lora")
    out["pp2_adapter"] = mlora.adapter_state_dict(state)
    parallel.destroy()
    return out


def _two_ranks(root):
    """Every save and load above in turn on two ranks, the refusals'
    (``dist_checkpoint_refusal_test``) among them, under `root`."""
    from twinkle_fn.backends.megatron.dist_checkpoint_refusal_test import (
        _failed_saves,
        _foreign_loads,
        _refusals,
    )

    out = {}
    # tp2: train, save, train on (the run that never saved).
    state, out["first"] = _steps(_state({"tp": 2}), 0, 2)
    _advance_rng()
    saved_rng = _rng()
    out["saved"] = tf.unshard(state)
    out["saved_step"] = (int(state.step), int(state.rng), int(state.opt_state.count))
    tf.checkpoint.save(state, root / "ckpt", extra={"consumed": 16})
    out["ids"], out["megatron_logits"] = _logits(state)
    out["failed"] = _failed_saves(state, root)
    state, out["tp2_straight"] = _steps(state, 2, 2)
    out["tp2_straight_params"] = tf.unshard(state)
    parallel.destroy()

    # tp2 again: the same mesh restores the RNG states, and training goes on bit-identically.
    state = tf.checkpoint.load(_state({"tp": 2}, seed=1), root / "ckpt")
    out["tp2_rng_restored"] = _same_rng(_rng(), saved_rng)
    out["tp2_step"] = (int(state.step), int(state.rng), int(state.opt_state.count))
    state, out["tp2_resumed"] = _steps(state, 2, 2)
    out["tp2_resumed_params"] = tf.unshard(state)
    parallel.destroy()

    # pp2: the reference run that never saved, then the resumed one.
    state, losses = _steps(_state({"pp": 2}), 0, 4)
    out["pp2_straight"], out["pp2_straight_params"] = losses[2:], tf.unshard(state)
    parallel.destroy()
    fresh = _state({"pp": 2}, seed=1)
    fresh_rng = _rng()
    state = tf.checkpoint.load(fresh, root / "ckpt")
    out["pp2_rng_kept"] = _same_rng(_rng(), fresh_rng) and not _same_rng(fresh_rng, saved_rng)
    out["pp2_loaded"] = tf.unshard(state)
    tf.checkpoint.save(state, root / "resaved_pp2")
    saved, resaved = (_plain(root / name) for name in ("ckpt", "resaved_pp2"))
    out["resaved_keys"] = sorted(saved)
    out["resaved_differ"] = sorted(saved.keys() ^ resaved.keys()) + [
        k for k in saved.keys() & resaved.keys() if not _same_rows(saved[k], resaved[k])
    ]
    state, out["pp2_resumed"] = _steps(state, 2, 2)
    out["pp2_resumed_params"] = tf.unshard(state)
    parallel.destroy()

    # dp2: the distributed optimizer shards the loaded state over two data ranks.
    state = tf.checkpoint.load(_state({"dp": 2}, seed=1), root / "ckpt")
    out["dp2_loaded"] = tf.unshard(state)
    state, out["dp2_resumed"] = _steps(state, 2, 2)
    out["dp2_resumed_params"] = tf.unshard(state)
    out["refusals"] = _refusals(root)
    out["foreign"] = _foreign_loads(root)
    out["fp16"] = _fp16(root)
    parallel.destroy()
    out["moe"] = _moe(root)
    out["lora"] = _lora(root)
    return out


def _assert_equal(got, want):
    assert got.keys() == want.keys()
    for n in want:
        assert torch.equal(got[n], want[n]), n


def _assert_close(got, want):
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=PARAM_ATOL, msg=n)


def test_resumed_on_the_same_mesh_equals_never_saving(runs):
    for out in runs[1]:
        assert out["saved_step"][0] == out["saved_step"][2] == 2
        assert out["tp2_step"] == out["saved_step"]
        assert out["tp2_resumed"] == out["tp2_straight"]
        _assert_equal(out["tp2_resumed_params"], out["tp2_straight_params"])


@pytest.mark.parametrize("mesh", ["pp2", "dp2"])
def test_load_on_another_mesh_is_exact(runs, mesh):
    for out in runs[1]:
        _assert_equal(out[f"{mesh}_loaded"], out["saved"])


def test_resaved_on_another_mesh_every_tensor_is_identical(runs):
    """Model, fp32 main parameters and both Adam moments, saved on tp2 and re-saved on pp2."""
    for out in runs[1]:
        assert out["resaved_differ"] == []
        keys = out["resaved_keys"]
        for kind in ("fp32_param", "exp_avg", "exp_avg_sq"):
            assert f"optimizer.state.{kind}.embedding.word_embeddings.weight" in keys
        assert "embedding.word_embeddings.weight" in keys


def test_resumed_on_pp2_matches_a_pp2_run_that_never_saved(runs):
    for out in runs[1]:
        assert out["pp2_resumed"] == pytest.approx(out["pp2_straight"], rel=LOSS_RTOL)
        assert out["pp2_resumed"] == pytest.approx(out["tp2_straight"], rel=LOSS_RTOL)
        _assert_close(out["pp2_resumed_params"], out["pp2_straight_params"])
        assert out["dp2_resumed"] == pytest.approx(out["tp2_straight"], rel=LOSS_RTOL)
        _assert_close(out["dp2_resumed_params"], out["tp2_straight_params"])


def test_rng_states_are_restored_on_the_same_mesh_only(runs):
    for out in runs[1]:
        assert out["tp2_rng_restored"]
        assert out["pp2_rng_kept"]


def test_the_fp16_grad_scaler_round_trips(runs):
    for out in runs[1]:
        saved, initial, loaded, steps = out["fp16"]
        assert saved["hysteresis_tracker"] != initial["hysteresis_tracker"]
        assert loaded["hysteresis_tracker"] == saved["hysteresis_tracker"]
        assert loaded["growth_tracker"] == saved["growth_tracker"]
        assert torch.equal(loaded["scale"], saved["scale"])
        assert steps == (1, 0)


def test_hf_export_loads_in_transformers_with_megatron_logits(runs):
    root, per_rank = runs
    out = per_rank[0]
    hf = AutoModelForCausalLM.from_pretrained(root / "ckpt").eval()
    params = dict(hf.named_parameters())
    _assert_equal({n: p.detach() for n, p in params.items()}, out["saved"])
    with torch.no_grad():
        logits = hf(input_ids=out["ids"]).logits
    torch.testing.assert_close(logits, out["megatron_logits"], rtol=0, atol=LOGITS_ATOL)


def test_an_moe_checkpoint_moves_from_expert_parallel_to_pp2_and_exports_hf(runs):
    root, per_rank = runs
    for out in per_rank:
        saved, loaded = out["moe"]
        _assert_equal(loaded, saved)
    hf = AutoModelForCausalLM.from_pretrained(root / "moe")
    _assert_equal(revert_weight_conversion(hf, hf.state_dict()), per_rank[0]["moe"][0])


def test_a_lora_state_saves_its_adapters_and_resumes_exactly(runs):
    """The checkpoint of a LoRA state holds the adapters (a peft directory) and their training
    state, not the frozen base weights; resumed on the same mesh it trains on bit-identically,
    and loads on another mesh (pp2) as the same adapter."""
    root, outs = runs
    saved = load_file(root / "lora" / "adapter_model.safetensors")
    for out in outs:
        lora = out["lora"]
        assert "model.safetensors" not in lora["files"] and "adapter_config.json" in lora["files"]
        _assert_equal(saved, lora["adapter"])
        assert lora["step"] == 2 and lora["resumed"] == lora["straight"]
        _assert_equal(lora["resumed_adapter"], lora["straight_adapter"])
        _assert_equal(lora["pp2_adapter"], lora["adapter"])
