"""Checkpoints of megatron states (`tf.checkpoint.save` / `load` through dist_checkpointing):
exact round trips on the same mesh and across tp2 -> pp2, tp2 -> dp2 and (MoE) dp2 x ep2 ->
pp2, RNG states restored only on the same mesh, the fp16 grad scaler restored, failed saves
leave nothing loadable, and the HF export loads in transformers with the Megatron model's logits.

Two spawned gloo ranks run every mesh in turn (megatron-core takes seconds to import). The model
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
import math
import shutil
from unittest import mock

import pytest
import torch
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.core_model_loading import revert_weight_conversion

import twinkle_fn as tf
from twinkle_fn.backends.megatron import dist_checkpoint, parallel
from twinkle_fn.backends.megatron import lora as mlora
from twinkle_fn.backends.megatron.backend import megatron_optimizer
from twinkle_fn.backends.megatron.placement import model_placement
from twinkle_fn.data import pack
from twinkle_fn.distributed import rank
from twinkle_fn.testing import random_features, tiny_config
from twinkle_fn.testing_dist import spawn

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


def _failed_saves(state, root):
    """A save that fails on every rank after the dist checkpoint is written: into a new path
    and over the complete checkpoint at ``root / "ckpt"``."""
    errors = []
    with mock.patch.object(dist_checkpoint, "full_weights", side_effect=KeyboardInterrupt):
        for name in ("other", "ckpt"):
            try:
                tf.checkpoint.save(state, root / name)
            except KeyboardInterrupt:
                errors.append(name)
    return errors


def _refusals(root):
    """Loads and saves that must fail before touching the state."""
    out = {}
    if rank() == 0:
        shutil.copytree(root / "ckpt", root / "no_manifest")
        (root / "no_manifest" / tf.checkpoint.MANIFEST).unlink()
    torch.distributed.barrier()
    state = _state({"dp": 2})
    for what, call in (
        ("no manifest", lambda: tf.checkpoint.load(state, root / "no_manifest")),
        ("copy", lambda: tf.checkpoint.load(state, root / "ckpt", donate=False)),
    ):
        with pytest.raises(ValueError) as error:
            call()
        out[what] = (str(error.value), state.donated)
    with pytest.raises(ValueError) as error:
        tf.checkpoint.save(_state({"dp": 2}, tx=tf.optim.adamw(1e-3)), root / "refused")
    out["plain transform"] = (str(error.value), (root / "refused").exists())
    return out


def _foreign_loads(root):
    """Loads refused before they write: a checkpoint of another hidden size (its HF files, and
    its dist checkpoint's metadata checked alone), HF weights holding NaN (by load_weights and
    by a model built with from_pretrained), a dist checkpoint whose Adam moments hold an
    infinity on one rank (every rank refuses). Per case: the
    message, whether the state was donated, whether its weights stayed bit-identical, and the
    loss of a step taken with it afterwards."""
    if rank() == 0:
        shutil.copytree(root / "ckpt", root / "nan_weights")
        file = root / "nan_weights" / "model.safetensors"
        tensors = load_file(file)
        tensors["model.layers.1.mlp.up_proj.weight"][3, 4] = float("nan")
        save_file(tensors, file, metadata={"format": "pt"})
    torch.distributed.barrier()
    out = {}
    other = tiny_config("qwen2", tie_word_embeddings=True, hidden_size=64)
    for what, config, call in (
        ("other size", other, lambda s: tf.checkpoint.load(s, root / "ckpt")),
        ("nan weights", CONFIG, lambda s: tf.checkpoint.load_weights(s, root / "nan_weights")),
    ):
        state = _state({"dp": 2}, config=config)
        before = tf.unshard(state)
        with pytest.raises(ValueError) as error:
            call(state)
        donated, after = state.donated, tf.unshard(state)
        same = before.keys() == after.keys() and all(
            torch.equal(before[k], after[k]) for k in before
        )
        out[what] = (str(error.value), donated, same, _steps(state, 0, 1)[1][0])
        if what == "other size":
            sharded = {"model": model_placement(state.model).module.sharded_state_dict()}
            with pytest.raises(ValueError) as error:
                dist_checkpoint._check_metadata(sharded, root / "ckpt" / dist_checkpoint.DIST_DIR)
            out["metadata"] = str(error.value)
    state, _ = _steps(_state({"dp": 2}), 0, 1)
    if rank() == 0:  # an Adam moment on one rank only: a save checks the parameters alone
        slot = next(iter(state.opt_state.optimizer.chained_optimizers[0].optimizer.state.values()))
        slot["exp_avg"].view(-1)[0] = float("inf")
    tf.checkpoint.save(state, root / "inf_moments")
    state = _state({"dp": 2}, seed=1)
    before = tf.unshard(state)
    with pytest.raises(ValueError) as error:
        tf.checkpoint.load(state, root / "inf_moments")
    after = tf.unshard(state)
    same = all(torch.equal(before[k], after[k]) for k in before)
    out["inf moments"] = (str(error.value), state.donated, same, _steps(state, 0, 1)[1][0])
    model = tf.models.from_pretrained(root / "nan_weights", backend="megatron")
    with pytest.raises(ValueError) as error:
        tf.init(model, megatron_optimizer(LR), tf.Mesh(dp=2))
    out["nan from_pretrained"] = str(error.value)
    return out


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


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_ckpt")
    return root, spawn(_two_ranks, 2, root, timeout_s=300)


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


def test_failed_saves_leave_nothing_loadable(runs):
    """A save that fails after the dist checkpoint is written leaves no directory, and one over
    ``ckpt`` leaves it as it was (every resume above loaded it after that failure)."""
    root, per_rank = runs
    for out in per_rank:
        assert out["failed"] == ["other", "ckpt"]
        refusals = out["refusals"]
        assert "not a complete twinkle checkpoint" in refusals["no manifest"][0]
        assert "donate=False" in refusals["copy"][0]
        assert not refusals["no manifest"][1] and not refusals["copy"][1]
        message, exists = refusals["plain transform"]
        assert "megatron_optimizer" in message and not exists
    names = sorted(p.name for p in root.iterdir())
    assert names == [
        "ckpt",
        "fp16",
        "inf_moments",
        "lora",
        "moe",
        "nan_weights",
        "no_manifest",
        "resaved_pp2",
    ]
    assert tf.checkpoint.read_extra(root / "ckpt") == {"consumed": 16}


def test_a_foreign_or_damaged_load_is_refused_before_it_writes(runs):
    for out in runs[1]:
        foreign = out["foreign"]
        message, donated, same, loss = foreign["other size"]
        assert "'model.embed_tokens.weight' has shape (96, 32)" in message, message
        assert "model expects (96, 64)" in message and not donated and same
        assert math.isfinite(loss)
        message, donated, same, loss = foreign["nan weights"]
        assert "holds NaN or infinity" in message and "nan_weights" in message, message
        assert not donated and same and math.isfinite(loss)
        # the dist checkpoint's own metadata names the tensor and both shapes too
        assert "has shape" in foreign["metadata"] and "expects" in foreign["metadata"]
        assert "megatron" in foreign["metadata"]
        message, donated, same, loss = foreign["inf moments"]
        assert "holds NaN or infinity" in message and "inf_moments" in message, message
        assert not donated and same and math.isfinite(loss)
        # a model directory read by each rank's slices is checked the same way
        message = foreign["nan from_pretrained"]
        assert "nan_weights" in message and "holds NaN or infinity" in message, message


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


def test_a_transformers_state_refuses_a_megatron_checkpoint(runs):
    model = tf.models.from_hf_config(CONFIG, seed=0, device="cpu")
    state = tf.init(model, tf.optim.adamw(1e-3))
    with pytest.raises(ValueError, match="holds a 'megatron' train state"):
        tf.checkpoint.load(state, runs[0] / "ckpt")
    assert not state.donated


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
