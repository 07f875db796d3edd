"""`load_hf_weights` copies exactly the bridge's slices into a stage and refuses weights that do
not fit it or hold NaN before it writes; `_Overlay` reads the files first and the module's
tensors where the files lack one. Loading through `place` on every mesh is `backend_test`'s,
into a live state from a directory `dist_checkpoint_test`'s."""

import pytest
import torch
from safetensors.torch import save_file

import twinkle_fn as tf
from twinkle_fn.backends.megatron.bridge import hf_to_mcore
from twinkle_fn.backends.megatron.hf_weights import _Overlay, load_hf_weights
from twinkle_fn.backends.megatron.model import build_gpt_model
from twinkle_fn.backends.megatron.safetensors_io import SafetensorsReader
from twinkle_fn.backends.megatron.sharding import checkpoint_names
from twinkle_fn.testing import tiny_config


def _model(**overrides):
    return tf.models.from_hf_config(tiny_config("qwen2", **overrides), seed=0, backend="megatron")


def _own(gpt):
    return {k: v.clone() for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}


def test_a_load_copies_the_bridges_slices_and_a_refused_one_writes_nothing(megatron_world):
    model = _model()
    gpt = build_gpt_model(model.config, tf.Mesh())
    load_hf_weights(gpt, model, tf.Mesh(), 128)
    want = hf_to_mcore(checkpoint_names(model, model.module.state_dict()), model.config)
    loaded = _own(gpt)
    assert loaded.keys() == want.keys()
    assert all(torch.equal(loaded[k], want[k]) for k in want)

    with torch.no_grad():
        model.module.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"'decoder\.layers\.1\.mlp\.linear_fc2\.weight'.*NaN"):
        load_hf_weights(gpt, model, tf.Mesh(), 128)
    with pytest.raises(RuntimeError, match="do not fit the megatron model"):
        load_hf_weights(gpt, _model(intermediate_size=32), tf.Mesh(), 128)
    after = _own(gpt)
    assert all(torch.equal(after[k], loaded[k]) for k in loaded)


def test_the_overlay_reads_the_files_first_and_held_tensors_where_they_lack_one(tmp_path):
    on_disk = torch.arange(6.0).view(3, 2)
    save_file({"a": on_disk}, tmp_path / "model.safetensors")
    held = {"a": torch.zeros(3, 2), "b": torch.arange(4.0).view(2, 2)}
    with SafetensorsReader(tmp_path) as files:
        overlay = _Overlay(files, held)
        assert overlay.shape("a") == (3, 2)
        assert torch.equal(overlay.get("a"), on_disk)
        assert torch.equal(overlay.get_rows("a", 0, 1, 3), on_disk[1:3])
        assert overlay.shape("b") == (2, 2)
        assert torch.equal(overlay.get("b"), held["b"])
        assert torch.equal(overlay.get_rows("b", 1, 1, 2), held["b"][:, 1:2])
        with pytest.raises(KeyError, match="'c'"):
            overlay.shape("c")
