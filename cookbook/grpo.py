"""GRPO from the functional core, offline on CPU, on either backend.

A tiny random-init Qwen2 (the character tokenizer of the `twinkle train` demo) learns a format:
answer an arithmetic question with digits only. Each step samples a group of completions per
prompt with a plain HF model that holds the trainer's weights (`tf.export_weights` after every
update), scores them with a verifiable reward, turns rewards into group-normalised advantages,
records the old log-probabilities with `tf.token_logps`, and takes PPO epochs of the clipped
surrogate (`tf.losses.ppo_loss`) with `tf.fwd_bwd` and `tf.step`. The loop itself is
`twinkle_fn.grpo.iterations` (read it top to bottom; `twinkle rl` runs the same one)::

    python cookbook/grpo.py --steps 40
    python cookbook/grpo.py --steps 40 --backend megatron --beta 0.04
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from transformers import AutoModelForCausalLM

import twinkle_fn as tf
from twinkle_fn import grpo
from twinkle_fn.data import char_tokenizer
from twinkle_fn.testing import tiny_config


def run(
    steps: int = 40,
    prompts_per_step: int = 4,
    group_size: int = 8,
    max_new_tokens: int = 4,
    ppo_epochs: int = 2,
    beta: float = 0.0,
    lr: float = 1e-2,
    backend: str = "transformers",
    seed: int = 0,
) -> dict[str, Any]:
    """Train `steps` GRPO iterations; returns the mean held-out reward before and after, and
    each step's record (`twinkle_fn.grpo.iterations`)."""
    tokenizer = char_tokenizer()
    config = tiny_config("qwen2", vocab_size=len(tokenizer))
    # the trainer, on the chosen backend
    model = tf.models.from_hf_config(config, seed=seed, backend=backend)
    state = tf.init(model, tf.optim.adamw(lr))
    # the sampler: a plain HF model of the same architecture, fed by the trainer's stream
    sampler = AutoModelForCausalLM.from_config(config).eval()
    grpo.sync(sampler, state, torch.float32)
    reference = grpo.reference_of(sampler) if beta > 0 else None
    rl = grpo.GRPOConfig(
        prompts_per_step=prompts_per_step,
        group_size=group_size,
        max_new_tokens=max_new_tokens,
        ppo_epochs=ppo_epochs,
        beta=beta,
    )
    held_out = grpo.task_prompts(tokenizer, 8, seed=seed + 1)
    before = grpo.mean_reward(sampler, tokenizer, held_out, rl, seed=seed)
    train = grpo.task_prompts(tokenizer, steps * prompts_per_step, seed=seed)
    records = [
        record
        for _, record in grpo.iterations(
            state, sampler, tokenizer, train, rl, steps, seed=seed, reference=reference
        )
    ]
    after = grpo.mean_reward(sampler, tokenizer, held_out, rl, seed=seed)
    return {"reward_before": before, "reward_after": after, "records": records}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--backend", choices=("transformers", "megatron"), default="transformers")
    parser.add_argument("--beta", type=float, default=0.0, help="KL weight to the initial policy")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = run(steps=args.steps, beta=args.beta, backend=args.backend, seed=args.seed)
    print(f"mean reward before: {out['reward_before']:.3f}  after: {out['reward_after']:.3f}")


if __name__ == "__main__":
    main()
