"""`MegatronModel` with a LoRA adapter (one process, in the spawned ``runs`` of ``conftest.py``
shared with ``test_class_api_megatron.py``): only the adapter trains, its export loads in peft
with the Megatron model's logits to 1e-5 (as `twinkle_fn/megatron/lora_test.py`), its training
state saves and resumes, and misuse after training is refused."""

from pathlib import Path

import torch
from peft import PeftModel
from safetensors.torch import load_file
from test_class_api_megatron import GAS, STEPS, _ids
from transformers import AutoModelForCausalLM

from twinkle_fn.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS


def test_lora_adapter_trains_alone_and_loads_in_peft(runs):
    _, _, extra = runs
    run = extra["lora"]
    assert run["stepped"] == [False, True] * STEPS  # the adapter's gradient_accumulation_steps
    assert len(run["steps"]) == STEPS and all(s["grad_norm"] > 0 for s in run["steps"])
    # Only the adapter trains: the base weights stay bit-identical, every factor moves.
    assert run["frozen"] > 0 and run["frozen_changed"] == []
    assert run["trained"].keys() == run["at_init"].keys()
    assert all(".lora_A." in k or ".lora_B." in k for k in run["trained"])
    assert all(not torch.equal(t, run["at_init"][k]) for k, t in run["trained"].items())
    path = Path(run["path"])
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS, "tokenizer_config.json"} <= set(
        p.name for p in path.iterdir()
    )
    weights = load_file(path / ADAPTER_WEIGHTS)
    assert weights.keys() == run["trained"].keys()
    assert all(torch.equal(weights[k], t) for k, t in run["trained"].items())
    hf = AutoModelForCausalLM.from_pretrained(extra["model_dir"], dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, path).eval()
    ids, _ = _ids()
    with torch.no_grad():
        logits = peft_model(input_ids=ids).logits
        with peft_model.disable_adapter():
            base = peft_model(input_ids=ids).logits
    torch.testing.assert_close(logits, run["logits"], rtol=0, atol=1e-5)
    assert (logits - base).abs().max() > 1e-3  # the adapter was applied, not skipped


def test_lora_training_state_saves_and_resumes(runs):
    """save(save_optimizer=True) with an adapter writes it and its training state;
    resume_from_checkpoint brings a model trained on since back to it."""
    resumable = runs[2]["lora"]["resumable"]
    assert "train_state" in resumable["files"] and "adapter_model.safetensors" in resumable["files"]
    assert resumable["progress"] == {
        "cur_step": STEPS,
        "consumed_train_samples": 6,
        "gradient_accumulation_steps": GAS,
    }
    assert resumable["moved"] and resumable["back"]


def test_lora_misuse_is_refused_after_training(runs):
    _, _, extra = runs
    second, load, unknown = extra["lora"]["errors"]
    assert "one LoRA adapter per model" in second
    assert "loading adapter weights alone into MegatronModel is not supported yet" in load
    assert "adapter 'other' does not exist" in unknown
