"""Upstream's LoRA DPO cookbook loop (``cookbook/rl/dpo/dpo_lora.py``), on both model classes,
with its dataset replaced by fixed preference pairs: the same calls, in the same order, with the
same arguments (``DPOLoss(beta, loss_type='sigmoid', reference_free=False, sft_weight=0.0)``,
the reference from ``forward_only(inputs=..., disable_lora=True)`` fed back as
``forward_backward(inputs=..., ref_outputs=...)``, ``clip_grad_and_step()`` with
``gradient_accumulation_steps=2``) train the adapter on this `twinkle`.

Left out of the loop: ``add_metric(DPOMetric)`` (this build has no metrics beyond
``calculate_metric``'s), ``set_template`` (the pairs come encoded) and the Ray setup. The
cookbook's ``lora_dropout=0.05`` is 0 here: with dropout the core's DPO (an exact
linearisation over two forwards) draws two masks, and the test asserts the base stays fixed.

Checked: an update every 2 calls (the step count), finite losses, the adapter moves while the
base model stays bit-identical (``forward_only(disable_lora=True)`` before and after), the
trained adapter's log-probs differ from the base's, and the final ``save`` writes a peft
adapter.
"""

import math
import os

import pytest
import torch
from peft import LoraConfig

from twinkle import DeviceMesh
from twinkle.loss import DPOLoss
from twinkle.model import MegatronModel, TransformersModel
from twinkle.processor import InputProcessor
from twinkle_fn.testing import random_features, tiny_config
from twinkle_fn.testing_dist import spawn

BATCH_SIZE, GRADIENT_ACCUMULATION_STEPS, STEPS, LR, BETA = 2, 2, 4, 1e-2, 0.1


def _dataloader():
    """What the cookbook's DataLoader yields per step: rows with 'positive' / 'negative'
    encoded features and the row's other fields."""
    feats = random_features(2 * BATCH_SIZE * STEPS, seed=7)
    rows = [
        {"question": f"q{i}", "positive": feats[2 * i], "negative": feats[2 * i + 1]}
        for i in range(BATCH_SIZE * STEPS)
    ]
    return [rows[i : i + BATCH_SIZE] for i in range(0, len(rows), BATCH_SIZE)]


def prepare_dpo_batch(batch):
    """The cookbook's: [pos_1, neg_1, pos_2, neg_2, ...], each with the row's other fields."""
    result = []
    for row in batch:
        base_fields = {k: v for k, v in row.items() if k not in ("positive", "negative")}
        result.append({**base_fields, **row["positive"]})
        result.append({**base_fields, **row["negative"]})
    return result


def _cookbook(use_megatron: bool, out_dir: str) -> dict:
    os.chdir(out_dir)  # upstream's save() writes under ./output
    dataloader = _dataloader()
    if use_megatron:
        policy_mesh = DeviceMesh.from_sizes(world_size=1, dp_size=1)
        policy_model = MegatronModel(
            config=tiny_config(),
            device_mesh=policy_mesh,
            mixed_precision="no",
            seed=0,
            variable_seq_lengths=True,
        )
    else:
        policy_mesh = DeviceMesh.from_sizes(world_size=1, dp_size=1)
        policy_model = TransformersModel(
            config=tiny_config(), device_mesh=policy_mesh, mixed_precision="no", seed=0
        )
    max_steps = len(dataloader)
    lora_config = LoraConfig(target_modules="all-linear", r=8, lora_alpha=32, lora_dropout=0.0)
    policy_model.add_adapter_to_model(
        "default", lora_config, gradient_accumulation_steps=GRADIENT_ACCUMULATION_STEPS
    )
    if use_megatron:
        policy_model.set_optimizer("default", lr=LR, weight_decay=0.01, adapter_name="default")
        policy_model.set_lr_scheduler("default", lr_decay_steps=max_steps, adapter_name="default")
    else:
        policy_model.set_optimizer("AdamW", lr=LR, weight_decay=0.01)
        policy_model.set_lr_scheduler("CosineAnnealingLR", T_max=max_steps, eta_min=LR * 0.1)
    loss_fn = DPOLoss(beta=BETA, loss_type="sigmoid", reference_free=False, sft_weight=0.0)
    policy_model.set_loss(loss_fn)
    policy_model.set_processor(InputProcessor, padding_free=True)

    everything = [f for batch in dataloader for f in prepare_dpo_batch(batch)]
    base = policy_model.forward_only(inputs=everything, disable_lora=True)["logps"]
    adapter = {k: v.clone() for k, v in policy_model.get_state_dict().items()}
    losses, steps = [], []
    for optim_step, batch in enumerate(dataloader, 1):
        dpo_batch = prepare_dpo_batch(batch)
        ref_outputs = policy_model.forward_only(inputs=dpo_batch, disable_lora=True)
        out = policy_model.forward_backward(inputs=dpo_batch, ref_outputs=ref_outputs)
        policy_model.clip_grad_and_step()
        losses.append(out["loss"])
        if optim_step % GRADIENT_ACCUMULATION_STEPS == 0:
            steps.append(policy_model.calculate_metric(is_training=True)["step"])
    path = policy_model.save("dpo-lora-final-checkpoint")
    after = policy_model.get_state_dict()
    return dict(
        losses=losses,
        steps=steps,
        moved=[k for k in adapter if not torch.equal(after[k], adapter[k])],
        adapter=list(adapter),
        base=base,
        base_after=policy_model.forward_only(inputs=everything, disable_lora=True)["logps"],
        adapted=policy_model.forward_only(inputs=everything)["logps"],
        saved=sorted(os.listdir(path)),
    )


def _check(run):
    assert run["steps"] == [1, 2]  # one update per GRADIENT_ACCUMULATION_STEPS calls
    assert len(run["losses"]) == STEPS and all(torch.isfinite(torch.tensor(run["losses"])))
    # B starts at 0: the policy is the reference, z = 0, the loss log 2 (float32 sums)
    assert run["losses"][0] == pytest.approx(math.log(2), rel=1e-6)
    assert run["moved"] == run["adapter"] and run["adapter"]
    assert torch.equal(run["base_after"], run["base"])
    assert (run["adapted"] - run["base"]).abs().max() > 1e-3
    assert "adapter_model.safetensors" in run["saved"]


def test_upstream_dpo_lora_loop_on_transformers_model(tmp_path):
    cwd = os.getcwd()
    try:
        _check(_cookbook(False, str(tmp_path)))
    finally:
        os.chdir(cwd)


def test_upstream_dpo_lora_loop_on_megatron_model(tmp_path):
    _check(spawn(_cookbook, 1, True, str(tmp_path), timeout_s=300)[0])
