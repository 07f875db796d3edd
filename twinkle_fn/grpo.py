"""GRPO on a built-in verifiable task, composed from the core's functions: the one loop that
``cookbook/grpo.py`` and the ``twinkle rl`` command run.

The task: answer an arithmetic chat question (`twinkle_fn.data.arithmetic_dataset`) with digits
only; the reward is the fraction of the completion's characters that are digits, so a tiny
random-init model can learn it in a few steps. One iteration of `iterations`:

1. rollouts: `group_size` completions of each of `prompts_per_step` prompts, sampled at
   temperature 1 by a plain HF model (the sampler) that holds the trainer's weights;
2. rewards, and advantages normalised within each prompt's group (`group_advantages`);
3. the old policy's per-token log-probabilities (`tf.token_logps` on the trainer) and, with
   ``beta > 0``, the reference's (a frozen HF copy of the initial weights);
4. `ppo_epochs` of ``tf.fwd_bwd`` with `ppo_loss` (clipped surrogate, asymmetric clip, k3 KL)
   and ``tf.step``;
5. the new weights stream into the sampler (``tf.export_weights``, bucket by bucket).

The loop runs on whatever backend and mesh the state was built for: every rank samples the
whole batch from the same generator seed (so all ranks agree on it) and each data rank trains its
slice. Each iteration yields the new state and a record of the reward, the loss and timings
(tokens/s of the training step, GB/s of the weight stream).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from twinkle_fn.api import fwd_bwd, step, token_logps
from twinkle_fn.data import arithmetic_dataset, pad_collate
from twinkle_fn.distributed import rank
from twinkle_fn.export import export_weights
from twinkle_fn.losses import ClippedSurrogate, group_advantages, ppo_loss
from twinkle_fn.losses.cross_entropy import token_logps as label_logps
from twinkle_fn.state import TrainState


@dataclass(frozen=True)
class GRPOConfig:
    """The knobs of one GRPO iteration. `epsilon` / `epsilon_high`: the clip range of the ratio
    ``[1 - epsilon, 1 + epsilon_high]``; `beta`: the weight of the k3 KL to the reference (0: no
    reference); `max_new_tokens`: every completion's length (the task has no end of turn)."""

    prompts_per_step: int = 4
    group_size: int = 8
    max_new_tokens: int = 4
    ppo_epochs: int = 2
    epsilon: float = 0.2
    epsilon_high: float = 0.28
    beta: float = 0.0

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "group_size", "max_new_tokens", "ppo_epochs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GRPOConfig.{name} must be an int >= 1, got {value!r}")
        if self.group_size < 2:
            raise ValueError(
                f"GRPOConfig.group_size must be >= 2, got {self.group_size}: the advantages "
                "compare each sample with the others of its group"
            )
        # the clip range and beta are checked by `ppo_loss` itself, before any compute
        self.loss()

    def loss(self) -> ClippedSurrogate:
        """The token loss of the PPO epochs (raises ``ValueError`` for a bad clip or beta)."""
        return ppo_loss(self.epsilon, self.epsilon_high, beta=self.beta)


def reward(text: str) -> float:
    """The verifiable reward: the fraction of the completion's characters that are digits."""
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def task_prompts(tokenizer: PreTrainedTokenizerBase, n: int, seed: int) -> list[list[int]]:
    """`n` chat prompts (token ids up to the assistant's turn) asking arithmetic questions."""
    rows = arithmetic_dataset(n, seed=seed)
    return [
        tokenizer.apply_chat_template(row["messages"][:1], add_generation_prompt=True)["input_ids"]
        for row in rows
    ]


@torch.no_grad()
def rollouts(
    sampler: torch.nn.Module,
    prompt: Sequence[int],
    group_size: int,
    max_new_tokens: int,
    generator: torch.Generator,
) -> list[list[int]]:
    """`group_size` completions of `prompt`, each `max_new_tokens` long, sampled at temperature 1
    (the temperature of the trainer's log-probabilities) from `generator` (on the sampler's
    device). A plain loop over full forwards: for a few tokens it beats ``generate``'s per-call
    overhead."""
    device = next(sampler.parameters()).device
    ids = torch.tensor([list(prompt)], device=device).repeat(group_size, 1)  # [G, T]
    for _ in range(max_new_tokens):
        logits = sampler(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1]  # [G, V]
        probs = logits.float().softmax(-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], dim=1)
    return ids[:, len(prompt) :].tolist()


def mean_reward(
    sampler: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[int]],
    config: GRPOConfig,
    seed: int,
) -> float:
    """The mean reward of `config.group_size` samples of every prompt of `prompts` (a fixed
    generator `seed`, so two calls on the same weights agree)."""
    generator = _generator(sampler, seed)
    texts = [
        tokenizer.decode(c)
        for p in prompts
        for c in rollouts(sampler, p, config.group_size, config.max_new_tokens, generator)
    ]
    return sum(map(reward, texts)) / len(texts)


def sync(sampler: torch.nn.Module, state: TrainState, dtype: torch.dtype) -> int:
    """Load the trainer's weights into `sampler`, one bucket of HF-named tensors at a time (a
    collective on several ranks; a LoRA model's adapters merged into the base weights, which a
    plain HF sampler holds); returns the bytes streamed. Raises ``ValueError`` naming the
    tensors `sampler` has no parameter for (another architecture)."""
    nbytes = 0
    for bucket in export_weights(state, dtype=dtype, lora="merged"):
        unexpected = sampler.load_state_dict(dict(bucket), strict=False).unexpected_keys
        if unexpected:
            raise ValueError(
                f"the sampler has no parameters {unexpected[:3]} of the trainer's stream; build "
                "it from the trainer's config (AutoModelForCausalLM.from_config(model.config))"
            )
        nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
    return nbytes


def reference_of(sampler: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of `sampler` (call it right after the first `sync`: the initial policy)."""
    return copy.deepcopy(sampler).eval().requires_grad_(False)


def iterations(
    state: TrainState,
    sampler: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[int]],
    config: GRPOConfig,
    steps: int,
    *,
    seed: int = 0,
    reference: torch.nn.Module | None = None,
    sync_dtype: torch.dtype = torch.float32,
    start: int = 0,
) -> Iterator[tuple[TrainState, dict[str, Any]]]:
    """Iterations ``start .. steps - 1`` of GRPO; each yields the new state and its record.

    `sampler` is an HF causal LM of the trainer's architecture that already holds its weights
    (`sync`); `reference` (required when ``config.beta > 0``) the frozen initial policy
    (`reference_of`). Prompts are drawn from `prompts` per step, deterministically in `seed`
    and the step (a resumed run draws the same). The record: ``step`` (1-based), ``reward``
    (the mean reward of the step's rollouts, before the update), ``loss``, ``grad_norm`` and ``lr`` (of
    the last PPO epoch), ``tokens`` (the batch's tokens per PPO epoch), ``rollout_s``,
    ``train_s`` (old log-probs and every PPO epoch), ``train_tokens_per_s`` (PPO epochs' tokens
    over their seconds), ``sync_s`` and ``sync_gb_per_s``. The state passed in is donated by the
    first step; use only the yielded ones. Raises ``ValueError`` (before any compute) for a
    ``beta > 0`` without a reference, fewer `prompts` than ``prompts_per_step`` or a `start`
    outside ``[0, steps]``.
    """
    if config.beta > 0 and reference is None:
        raise ValueError(
            f"GRPOConfig.beta = {config.beta} needs a reference model for the KL term; pass "
            "reference=reference_of(sampler) after the first sync, or set beta=0"
        )
    if len(prompts) < config.prompts_per_step:
        raise ValueError(
            f"{len(prompts)} prompts are fewer than prompts_per_step "
            f"({config.prompts_per_step}); pass more prompts or lower prompts_per_step"
        )
    if not 0 <= start <= steps:
        raise ValueError(f"start must be in [0, steps={steps}], got {start}")
    loss = config.loss()
    for i in range(start, steps):
        generator = _generator(sampler, seed * 1_000_003 + i)
        tic = time.perf_counter()
        picked = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed + i))
        feats, rewards = [], []
        for j in picked[: config.prompts_per_step].tolist():
            prompt = list(prompts[j])
            for completion in rollouts(
                sampler, prompt, config.group_size, config.max_new_tokens, generator
            ):
                # labels already shifted: position t predicts ids[t + 1]; only the completion
                labels = [-100] * (len(prompt) - 1) + completion + [-100]
                feats.append({"input_ids": prompt + completion, "labels": labels})
                rewards.append(reward(tokenizer.decode(completion)))
        advantages = group_advantages(rewards, config.group_size).tolist()  # one per sample
        for f, a in zip(feats, advantages, strict=True):
            f["advantages"] = a
        mesh = state.mesh
        if mesh is not None and mesh.data_world_size > 1:
            feats = feats[mesh.get_slice(len(feats), rank())]  # this data rank's slice
        rollout_s = _seconds(tic, sampler)

        tic = time.perf_counter()
        batch = pad_collate(feats, pad_token_id=0)
        old = token_logps(state, batch)["logps"]  # [B, T]: the policy that sampled
        ref = _reference_logps(reference, batch) if config.beta > 0 else None  # [B, T]
        for row, f in enumerate(feats):
            n = len(f["input_ids"])
            f["old_logps"] = old[row, :n].tolist()
            if ref is not None:
                f["ref_logps"] = ref[row, :n].tolist()
        batch = pad_collate(feats, pad_token_id=0)
        epochs_tic = time.perf_counter()
        for _ in range(config.ppo_epochs):
            grads, _ = fwd_bwd(state, batch, loss=loss)
            state, info = step(state, grads)
        train_s = _seconds(tic, sampler)
        epochs_s = _seconds(epochs_tic, sampler)

        tic = time.perf_counter()
        nbytes = sync(sampler, state, sync_dtype)
        sync_s = _seconds(tic, sampler)
        tokens = int(batch["input_ids"].numel())
        record = {
            "step": i + 1,
            "reward": sum(rewards) / len(rewards),
            "loss": float(info["loss"]),
            "grad_norm": float(info["grad_norm"]),
            "lr": info["lr"],
            "tokens": tokens,
            "rollout_s": rollout_s,
            "train_s": train_s,
            "train_tokens_per_s": tokens * config.ppo_epochs / epochs_s,
            "sync_s": sync_s,
            "sync_gb_per_s": nbytes / 1e9 / sync_s,
        }
        yield state, record


@torch.no_grad()
def _reference_logps(
    reference: torch.nn.Module, batch: dict[str, torch.Tensor], rows: int = 16
) -> torch.Tensor:
    """The reference model's log-probabilities of `batch`'s labels, ``[B, T]`` (0 where -100),
    `rows` sequences at a time (a large vocabulary's ``[rows, T, V]`` logits stay bounded)."""
    device = next(reference.parameters()).device
    out = []
    for start in range(0, batch["input_ids"].shape[0], rows):
        part = slice(start, start + rows)
        logits = reference(
            input_ids=batch["input_ids"][part].to(device),
            attention_mask=batch["attention_mask"][part].to(device),
            use_cache=False,
        ).logits  # [rows, T, V]
        out.append(label_logps(logits, batch["labels"][part].to(device)).float().cpu())
    return torch.cat(out)


def _generator(sampler: torch.nn.Module, seed: int) -> torch.Generator:
    device = next(sampler.parameters()).device
    return torch.Generator(device=device).manual_seed(seed)


def _seconds(tic: float, sampler: torch.nn.Module) -> float:
    """Seconds since `tic`, after the sampler's device has finished its queued work."""
    device = next(sampler.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - tic
