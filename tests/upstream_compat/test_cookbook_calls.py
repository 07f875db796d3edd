"""The model calls upstream's current cookbook scripts make, on one process: ``optimizer_cls=
torch.optim.Muon`` (with ``adjust_lr_fn``) and torch's kernel switches, ``optimizer_group[
name].cur_step``, ``forward_backward(task=...)``, ``save(..., merge_lora=True)``, template class
names, and a mesh with ``ulysses_size`` carved out of the data ranks."""

import runpy
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM

from twinkle import DeviceMesh
from twinkle.dataset import make_template
from twinkle.model import TransformersModel
from twinkle.template import Qwen3_5Template, Template
from twinkle_fn.optim.muon import adjusted_lr, newton_schulz
from twinkle_fn.testing import random_features, tiny_config

COOKBOOK = Path(__file__).resolve().parents[2] / "cookbook"
LORA = LoraConfig(target_modules="all-linear", r=4, lora_alpha=8, lora_dropout=0.0)


def _lora_model(**kwargs):
    model = TransformersModel(mixed_precision="no", seed=0, dtype=torch.float64, **kwargs)
    model.add_adapter_to_model("default", LORA, gradient_accumulation_steps=2)
    return model


def test_muon_by_class_orthogonalises_each_update():
    """One Muon step (momentum 0, no decay) moves each matrix by ``-adjusted_lr * NS(grad)``:
    the Newton-Schulz orthogonalisation of its gradient (torch's bfloat16 iteration, so the
    update matches NS of the float64 gradient to bfloat16's 2**-8 relative precision)."""
    model = _lora_model(config=tiny_config())
    lr = 1e-2
    model.set_optimizer(
        torch.optim.Muon, lr=lr, momentum=0.0, weight_decay=0.0, adjust_lr_fn="match_rms_adamw"
    )
    feats = random_features(4, seed=3)
    before = {k: v.clone() for k, v in model.get_state_dict().items()}
    for half in (feats[:2], feats[2:]):
        model.forward_backward(inputs=half)
    grads = {k: g.clone() for k, g in model._resolve(None).pending.grads.params.items()}
    total = model._resolve(None).pending.grads.num_tokens
    model.clip_grad_and_step(max_grad_norm=1e9)
    after = model.get_state_dict()
    moved = 0
    for name, grad in grads.items():
        g = grad / total  # the step normalises the token sums
        if not g.abs().sum():
            continue  # lora_A at B = 0 gets no gradient, and no update
        key = next(k for k in before if k.endswith(name.split("base_model.model.")[-1]))
        want = -adjusted_lr(lr, "match_rms_adamw", g.shape) * newton_schulz(g).double()
        torch.testing.assert_close(after[key] - before[key], want, rtol=1e-2, atol=1e-4)
        moved += 1
    assert moved > 0
    assert "Muon" in model.get_train_configs()


def test_torch_kernel_switches_and_adam_are_accepted():
    model = _lora_model(config=tiny_config())
    model.set_optimizer("Adam", lr=1e-3, foreach=True)
    model.set_optimizer(torch.optim.AdamW, lr=1e-3, fused=False)
    with pytest.raises(ValueError, match="unknown optimizer 'Adagrad'"):
        model.set_optimizer("Adagrad", lr=1e-3)
    with pytest.raises(ValueError, match="adjust_lr_fn must be one of"):
        model.set_optimizer(torch.optim.Muon, adjust_lr_fn="rms")


def test_cur_step_counts_micro_batches_and_tasks():
    model = _lora_model(config=tiny_config())
    group = model.optimizer_group["default"]
    assert list(model.optimizer_group) == ["default"] and group.cur_step == 0
    feats = random_features(6, seed=1)
    for i in range(3):
        model.forward_backward(inputs=feats[2 * i : 2 * i + 2], task="causal_lm")
        model.clip_grad_and_step()
    # upstream counts forward_backward calls; two of them make one optimizer step here
    assert group.cur_step == 3 and group.gradient_accumulation_steps == 2
    assert model.calculate_metric()["step"] == 1
    with pytest.raises(ValueError, match=r"task='fused_lm_ce'.*Liger's fused linear cross"):
        model.forward_backward(inputs=feats[:2], task="fused_lm_ce")
    with pytest.raises(ValueError, match="task='seq_cls'\\): not a task of this build"):
        model.forward_backward(inputs=feats[:2], task="seq_cls")


def test_save_merge_lora_is_the_merged_hf_model(tmp_path):
    """``save(merge_lora=True)`` writes a plain HF model whose logits are peft's base model with
    the saved adapter applied. The export merges ``W + scaling * B @ A`` in float32 (as for a
    rollout engine), so a float64 model's merged weights carry float32 rounding (2**-24
    relative): logits agree to 1e-6 (observed 1.8e-8)."""
    make = runpy.run_path(str(COOKBOOK / "make_tiny_model.py"))["make_tiny_model"]
    base_dir = make(tmp_path / "base", hidden_size=32)
    model = _lora_model(model_id=base_dir)
    model.set_optimizer("AdamW", lr=1e-2)
    feats = random_features(4, seed=2, vocab_size=64)
    for half in (feats[:2], feats[2:]):
        model.forward_backward(inputs=half)
        model.clip_grad_and_step()
    adapter = model.save("adapter", output_dir=tmp_path)
    merged = model.save("merged", output_dir=tmp_path, merge_lora=True)
    files = sorted(p.name for p in Path(merged).iterdir())
    assert "config.json" in files and "adapter_config.json" not in files
    ids = torch.tensor([f["input_ids"] for f in feats[:1]])
    hf = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float64).eval()
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64)
    peft = PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        got, want = hf(input_ids=ids).logits, peft(input_ids=ids).logits
        with peft.disable_adapter():
            plain = peft(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert (want - plain).abs().max() > 1e-6  # the adapter was trained and merged


def test_template_names_and_ulysses_mesh(tmp_path):
    make = runpy.run_path(str(COOKBOOK / "make_tiny_model.py"))["make_tiny_model"]
    model_dir = make(tmp_path / "tiny", hidden_size=32)
    template = make_template("Qwen3_5Template", model_id=model_dir)
    assert isinstance(template, Qwen3_5Template)
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    assert template.encode(chat) == Template(model_dir).encode(chat)
    with pytest.raises(ValueError, match="unknown template 'Qwen9Template'; this build has"):
        make_template("Qwen9Template", model_id=model_dir)
    # upstream's sp_fsdp_dense.sh mesh: ulysses 2 out of dp 2 x fsdp 2, on 4 ranks
    mesh = DeviceMesh.from_sizes(dp_size=2, fsdp_size=2, ulysses_size=2)
    assert (mesh.world_size, mesh.data_world_size, mesh.ulysses_size) == (4, 2, 2)
