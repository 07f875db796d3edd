"""Failed saves and refused loads of megatron checkpoints, run on the two spawned ranks of
``dist_checkpoint_test`` (the session fixture ``runs`` of ``conftest.py``): a save that fails
after the dist checkpoint is written leaves nothing loadable, a checkpoint without its manifest,
a copying load and a plain transform are refused, a foreign or damaged checkpoint (another
hidden size, NaN weights, an infinite Adam moment) is refused before it writes, and a
transformers state refuses a megatron checkpoint."""

import math
import shutil
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file, save_file

import twinkle_fn as tf
from twinkle_fn.backends.megatron import dist_checkpoint
from twinkle_fn.backends.megatron.backend import megatron_optimizer
from twinkle_fn.backends.megatron.dist_checkpoint_test import CONFIG, LR, _state, _steps
from twinkle_fn.backends.megatron.placement import model_placement
from twinkle_fn.distributed import rank
from twinkle_fn.testing import tiny_config


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


def test_a_transformers_state_refuses_a_megatron_checkpoint(runs):
    model = tf.models.from_hf_config(CONFIG, seed=0, device="cpu")
    state = tf.init(model, tf.optim.adamw(1e-3))
    with pytest.raises(ValueError, match="holds a 'megatron' train state"):
        tf.checkpoint.load(state, runs[0] / "ckpt")
    assert not state.donated
