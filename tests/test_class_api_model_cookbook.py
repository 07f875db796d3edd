"""`TransformersModel` from a model directory (the cookbook's tiny model): chat trajectories are
encoded by the template, upstream's examples and the SFT LoRA cookbook train (and resume), and a
``config=`` next to ``model_id`` must be the directory's."""

import math
import runpy
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from test_class_api_model import CHATS

import twinkle
from twinkle.model import TransformersModel
from twinkle.template import Template
from twinkle_fn.data import encode_messages

COOKBOOK = Path(__file__).resolve().parent.parent / "cookbook"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    make = runpy.run_path(str(COOKBOOK / "make_tiny_model.py"))["make_tiny_model"]
    return make(tmp_path_factory.mktemp("tiny") / "model", hidden_size=32)


def test_chat_trajectories_are_encoded_by_the_template(model_dir):
    model = TransformersModel(model_id=model_dir, mixed_precision="no")
    out = model.forward_only(inputs=CHATS)
    tok = Template(model_dir).tokenizer
    feats = [encode_messages(tok, c["messages"]) for c in CHATS]
    ref = model.forward_only(inputs=feats)
    assert out.loss == ref.loss and torch.equal(out.logps, ref.logps)
    # assistant-only labels: one character token per answer character, plus <|im_end|> and \n
    assert out.num_tokens == sum(len(answer) + 2 for answer in ("5", "Blue."))
    single = model.forward_only(inputs=CHATS[0])
    assert single.logps.shape[0] == 1


def test_seed_example_runs_on_one_process(model_dir):
    """Upstream's TransformersModel usage example (cookbook), on one rank."""
    run = runpy.run_path(str(COOKBOOK / "transformers_fsdp2.py"))["run"]
    losses = run(
        str(model_dir),
        dp_size=1,
        fsdp_size=1,
        num_samples=48,
        batch_size=4,
        gradient_accumulation_steps=4,
        lr=1e-2,
    )
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]


def test_sft_lora_cookbook_trains_and_resumes(model_dir, tmp_path):
    before = twinkle.infra.settings()
    try:  # the script calls twinkle.initialize
        result = runpy.run_path(str(COOKBOOK / "sft_lora.py"))["run"](
            str(model_dir), str(tmp_path), steps=6, batch_size=8, num_samples=96, lr=1e-2
        )
    finally:
        twinkle.infra._SETTINGS[0] = before
    assert len(result["losses"]) == 6
    assert result["heldout_after"] < result["heldout_before"]
    model = TransformersModel(model_id=model_dir, mixed_precision="bf16")
    model.add_adapter_to_model("sft", LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    info = model.resume_from_checkpoint(result["checkpoint"])
    assert info == {
        "cur_step": 6,
        "consumed_train_samples": 6 * 8,
        "gradient_accumulation_steps": 2,
    }
    assert int(model.state.step) == 6


def test_model_id_takes_its_own_config_and_refuses_another(model_dir):
    """Upstream's EP cookbook passes ``config=AutoConfig.from_pretrained(model_id)`` (use_cache
    off) next to the model id: the directory's model loads; a config of another model is
    refused naming the fields."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    config.use_cache = False
    model = TransformersModel(model_id=model_dir, config=config, mixed_precision="no")
    assert model.get_train_configs()
    config.num_hidden_layers += 1
    with pytest.raises(ValueError, match=r"differs from the directory's config.json in \['num_"):
        TransformersModel(model_id=model_dir, config=config)
