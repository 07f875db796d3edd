"""Upstream's GRPO cookbook loop (``cookbook/rl/grpo/short_math_grpo.py``, transformers branch),
with its vLLM sampler replaced by fixed completions and their log-probs: the same calls, in the
same order, with the same arguments, train a LoRA adapter on this `twinkle`.

Checked: every step updates (the step count rises, the loss is finite, the adapter moves), the
base model stays as it was (``forward_only(disable_lora=True)``, upstream's reference log-probs,
is bit-identical before and after), and the reference log-probs fed back as ``ref_logps`` with
``beta > 0`` train too.
"""

import torch
from peft import LoraConfig

from twinkle.advantage import GRPOAdvantage
from twinkle.model import TransformersModel
from twinkle.processor import InputProcessor
from twinkle_fn.testing import random_features, tiny_config

NUM_GENERATIONS, MINI_BATCH_SIZE, MICRO_BATCH_SIZE, STEPS = 4, 4, 2, 2


def _sampled():
    """What the cookbook reads from the sampler: features (``new_input_feature``), each
    completion token's log-prob and a reward per completion."""
    feats = random_features(NUM_GENERATIONS * STEPS, seed=5)
    old_logps = [[-4.0 + 0.125 * (t % 5) for t in f["labels"] if t != -100] for f in feats]
    rewards = [float(i % 3 == 0) for i in range(len(feats))]
    return feats, old_logps, rewards


def test_upstream_grpo_loop_trains_a_lora_adapter():
    model = TransformersModel(config=tiny_config(), mixed_precision="no", seed=0)
    lora_config = LoraConfig(target_modules="all-linear", r=4, lora_alpha=8, lora_dropout=0.0)
    model.add_adapter_to_model("default", lora_config, gradient_accumulation_steps=1)
    model.set_optimizer("AdamW", lr=1e-2)
    model.set_lr_scheduler("CosineAnnealingLR", T_max=STEPS, eta_min=0)
    model.set_loss("GRPOLoss", epsilon=0.2, beta=0.04)
    model.set_processor(InputProcessor, padding_free=True)

    feats, all_old_logps, rewards = _sampled()
    base = model.forward_only(inputs=feats, disable_lora=True)["logps"]
    adapter = {k: v.clone() for k, v in model.get_state_dict().items()}  # live views
    advantages = GRPOAdvantage()(rewards, num_generations=NUM_GENERATIONS, scale="group").tolist()
    for step, start in enumerate(range(0, len(feats), MINI_BATCH_SIZE)):
        mb = slice(start, start + MINI_BATCH_SIZE)
        ref = model.forward_only(inputs=feats[mb], disable_lora=True)
        out = model.forward_backward(
            inputs=feats[mb],
            old_logps=all_old_logps[mb],
            advantages=advantages[mb],
            ref_logps=ref["logps"],
            micro_batch_size=MICRO_BATCH_SIZE,
        )
        model.clip_grad_and_step()
        metrics = model.calculate_metric(is_training=True)
        assert metrics["step"] == step + 1 and torch.isfinite(torch.tensor(out["loss"]))

    after = model.get_state_dict()
    assert any(not torch.equal(after[k], adapter[k]) for k in adapter)
    assert torch.equal(model.forward_only(inputs=feats, disable_lora=True)["logps"], base)
