"""`TransformersModel` checkpoints on one process: a save -> resume round trip then a step equals
stepping on (full parameters or an adapter), an adapter directory continues or reloads an
adapter, and the state dict and train configs name what trains. float64, bit-identical (see
``test_class_api_model.py``)."""

from pathlib import Path

import pytest
import torch
from test_class_api_model import LORA, _assert_identical, _model, _trained

import twinkle_fn as tf
from twinkle_fn.testing import random_features

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("adapter", [False, True])
def test_save_resume_then_step_equals_no_round_trip(adapter, tmp_path):
    """Checkpoint round trip: resuming and stepping gives the parameters of stepping on."""
    model = _trained(adapter=adapter)
    path = model.save(output_dir=tmp_path, save_optimizer=True, consumed_train_samples=6)
    assert Path(path).name == "checkpoint-step-2"
    assert model.save(output_dir=tmp_path, interval=4) is None  # 2 steps: not a multiple of 4
    feats = random_features(3, seed=99)
    model.forward_backward(inputs=feats)
    model.clip_grad_and_step()
    resumed = _model()
    if adapter:
        resumed.add_adapter_to_model("a", LORA)
    resumed.set_optimizer("AdamW", lr=1e-2)
    info = resumed.resume_from_checkpoint(path)
    assert info["cur_step"] == 2 and info["consumed_train_samples"] == 6
    resumed.forward_backward(inputs=feats)
    resumed.clip_grad_and_step()
    _assert_identical(resumed.get_state_dict(), model.get_state_dict())


def test_adapter_dir_continues_an_adapter_and_load_restores_weights(tmp_path):
    model = _trained(adapter=True)
    path = model.save("adapter", output_dir=tmp_path)
    assert (Path(path) / "adapter_model.safetensors").is_file()
    feats = random_features(2, seed=7)
    trained_logps = model.forward_only(inputs=feats).logps
    again = _model()
    again.add_adapter_to_model("b", path)
    torch.testing.assert_close(
        again.forward_only(inputs=feats).logps, trained_logps, rtol=0, atol=0
    )
    fresh = _model()
    fresh.add_adapter_to_model("a", LORA)
    fresh.load("adapter", output_dir=tmp_path)
    _assert_identical(fresh.get_state_dict(), model.get_state_dict())


def test_state_dict_and_train_configs():
    model = _trained(steps=1, adapter=True)
    state_dict = model.get_state_dict()
    assert state_dict and all("lora_" in n for n in state_dict)
    _assert_identical(state_dict, tf.unshard(model.state))
    text = model.get_train_configs()
    assert "adapter: a" in text and "AdamW" in text
