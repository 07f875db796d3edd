"""GRPO from the functional core, offline on CPU, readable top to bottom.

A tiny random-init Qwen2 (the character tokenizer of the `twinkle train` demo) learns a format:
answer an arithmetic question with digits only. Each step samples a group of completions per
prompt with a plain HF model that holds the trainer's weights (`tf.export_weights` after every
update), scores them with a verifiable reward, turns rewards into group-normalised advantages,
records the old log-probabilities with `tf.token_logps`, and takes PPO epochs of the clipped
surrogate (`tf.losses.ppo_loss`) with `tf.fwd_bwd` and `tf.step`::

    python cookbook/grpo.py --steps 40
"""

from __future__ import annotations

import argparse
import random
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

import twinkle_fn as tf
from twinkle_fn.data import arithmetic_dataset, char_tokenizer, pad_collate
from twinkle_fn.testing import tiny_config


def reward(text: str) -> float:
    """The verifiable reward: the fraction of the completion's characters that are digits."""
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def prompts(tokenizer: PreTrainedTokenizerBase, n: int, seed: int) -> list[list[int]]:
    """`n` chat prompts (ids up to the assistant's turn) asking arithmetic questions."""
    rows = arithmetic_dataset(n, seed=seed)
    return [
        tokenizer.apply_chat_template(row["messages"][:1], add_generation_prompt=True)["input_ids"]
        for row in rows
    ]


@torch.no_grad()
def rollouts(
    sampler: torch.nn.Module, prompt: list[int], group_size: int, max_new_tokens: int
) -> list[list[int]]:
    """`group_size` completions of `prompt`, each exactly `max_new_tokens` long (the task has no
    end of turn), sampled at temperature 1: the temperature of the trainer's log-probabilities.
    A plain loop over full forwards: for a few tokens of a tiny model it beats ``generate``'s
    per-call overhead."""
    ids = torch.tensor([prompt]).repeat(group_size, 1)  # [G, T]
    for _ in range(max_new_tokens):
        logits = sampler(input_ids=ids, use_cache=False).logits[:, -1]  # [G, V]
        ids = torch.cat([ids, torch.multinomial(logits.softmax(-1), 1)], dim=1)
    return ids[:, len(prompt) :].tolist()


def mean_reward(
    sampler: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    batch: list[list[int]],
    group_size: int,
    max_new_tokens: int,
) -> float:
    """The mean reward of `group_size` samples of every prompt of `batch`."""
    texts = [
        tokenizer.decode(c) for p in batch for c in rollouts(sampler, p, group_size, max_new_tokens)
    ]
    return sum(map(reward, texts)) / len(texts)


def sync(sampler: torch.nn.Module, state: tf.TrainState) -> None:
    """Load the trainer's weights into the sampler, one bucket of HF-named tensors at a time."""
    for bucket in tf.export_weights(state, dtype=torch.float32):
        sampler.load_state_dict(dict(bucket), strict=False)


def run(
    steps: int = 40,
    prompts_per_step: int = 4,
    group_size: int = 8,
    max_new_tokens: int = 4,
    ppo_epochs: int = 2,
    lr: float = 1e-2,
    seed: int = 0,
) -> dict[str, Any]:
    """Train `steps` GRPO iterations; returns the mean reward before and after, per step."""
    torch.manual_seed(seed)  # the sampler draws from torch's global generator
    tokenizer = char_tokenizer()
    config = tiny_config("qwen2", vocab_size=len(tokenizer))
    state = tf.init(tf.models.from_hf_config(config, seed=seed), tf.optim.adamw(lr))
    sampler = AutoModelForCausalLM.from_config(config).eval()
    sync(sampler, state)
    loss = tf.losses.ppo_loss(epsilon=0.2, epsilon_high=0.28)
    held_out = prompts(tokenizer, 8, seed=seed + 1)
    before = mean_reward(sampler, tokenizer, held_out, group_size, max_new_tokens)
    train = prompts(tokenizer, steps * prompts_per_step, seed=seed)
    rng = random.Random(seed)
    rewards_per_step = []
    for _ in range(steps):
        # 1. rollouts: a group of completions per prompt, from the sampler (the current policy)
        feats, rewards = [], []
        for prompt in rng.sample(train, prompts_per_step):
            for completion in rollouts(sampler, prompt, group_size, max_new_tokens):
                ids = prompt + completion
                # labels already shifted: position t predicts ids[t + 1]; only the completion
                labels = [-100] * (len(prompt) - 1) + completion + [-100]
                feats.append({"input_ids": ids, "labels": labels})
                rewards.append(reward(tokenizer.decode(completion)))
        rewards_per_step.append(sum(rewards) / len(rewards))
        # 2. advantages: each reward against its prompt's group (one number per sample)
        advantages = tf.losses.group_advantages(rewards, group_size).tolist()
        # 3. old log-probs: the policy that sampled, as the trainer computes it
        batch = pad_collate(feats, pad_token_id=0)
        old = tf.token_logps(state, batch)["logps"]  # [B, T]
        for row, f in enumerate(feats):
            f["advantages"] = advantages[row]
            f["old_logps"] = old[row, : len(f["input_ids"])].tolist()
        batch = pad_collate(feats, pad_token_id=0)
        # 4. PPO epochs over the same rollouts: the ratio leaves 1 and the clip starts to bind
        for _ in range(ppo_epochs):
            grads, _ = tf.fwd_bwd(state, batch, loss=loss)
            state, _ = tf.step(state, grads)
        # 5. the sampler gets the new weights before the next rollouts
        sync(sampler, state)
    after = mean_reward(sampler, tokenizer, held_out, group_size, max_new_tokens)
    return {"reward_before": before, "reward_after": after, "rewards": rewards_per_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = run(steps=args.steps, seed=args.seed)
    print(f"mean reward before: {out['reward_before']:.3f}  after: {out['reward_after']:.3f}")


if __name__ == "__main__":
    main()
