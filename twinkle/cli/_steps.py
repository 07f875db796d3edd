"""The pieces of the training loop: one update, the step cadences, checkpoints, the held-out
loss and the order samples are drawn in."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import twinkle_fn as tf
from twinkle.cli import config as cfg
from twinkle_fn.data import pack, split_features
from twinkle_fn.distributed import rank


def _train_step(
    state: tf.TrainState, feats: list[dict[str, Any]], mesh: tf.Mesh, micro: int, out: Path
) -> tuple[tf.TrainState, dict[str, Any]]:
    """One update from the global batch `feats`: this data rank's slice in `micro`
    accumulated micro-batches, then `tf.step` (donates `state`). Raises ``ValueError`` naming
    the step when the loss or gradient norm is not finite (nothing saved)."""
    grads = None
    local = feats[mesh.get_slice(len(feats), rank())]  # this data rank's
    for part in split_features(local, micro):
        grads, _ = tf.fwd_bwd(state, pack(part), accum=grads)
    try:
        return tf.step(state, grads, on_nonfinite="raise")
    except tf.NonFiniteError as e:
        raise ValueError(
            f"training diverged, stopping without saving (any checkpoint in {out} is left as it "
            f"was): {e}"
        ) from e


def _due(every: int, done: int, steps: int) -> bool:
    """Whether a cadence of `every` steps (0: never) falls after step `done`; the last step
    is left to the end of the run."""
    return bool(every) and done % every == 0 and done < steps


def _save_final(state: tf.TrainState, out: Path, tokenizer: Any, config: cfg.RunConfig) -> Path:
    """``<out>/checkpoint``, and with LoRA ``<out>/adapter`` (what
    ``peft.PeftModel.from_pretrained(base, dir)`` loads). Returns the checkpoint."""
    steps = config.schedule.steps
    if config.lora is not None:
        tf.lora.save_adapter(state, out / "adapter")
    return tf.checkpoint.save(state, out / "checkpoint", tokenizer=tokenizer, extra={"step": steps})


def _save(state: tf.TrainState, path: Path, tokenizer: Any, step: int) -> Path:
    """A checkpoint of `state` at `path` (its ``extra`` holds `step`, the data position)."""
    return tf.checkpoint.save(state, path, tokenizer=tokenizer, extra={"step": step})


def _heldout_loss(state: tf.TrainState, feats: list[dict[str, Any]], batch_size: int) -> float:
    """Token-mean loss over every held-out sample."""
    loss_sum, num_tokens = 0.0, 0
    for i in range(0, len(feats), batch_size):
        out = tf.evaluate(state, pack(feats[i : i + batch_size]))
        loss_sum += float(out.loss_sum)
        num_tokens += int(out.num_tokens)
    return loss_sum / max(num_tokens, 1)


def _sample_order(n: int, total: int, seed: int) -> list[int]:
    """Indices for `total` draws: shuffled epochs over `n` samples, deterministic in `seed`
    (so a resumed run finds its data position from the step alone)."""
    rng = random.Random(seed)
    order: list[int] = []
    while len(order) < total:
        epoch = list(range(n))
        rng.shuffle(epoch)
        order.extend(epoch)
    return order[:total]
