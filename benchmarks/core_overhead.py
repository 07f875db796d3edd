"""The functional core's own overhead: `tf.fwd_bwd` + `tf.step` vs a hand-written torch loop.

Both loops train the same tiny Qwen2 (same weights, same batches) with AdamW and global-norm
clipping; the hand-written one is the textbook ``model(...).logits -> cross_entropy -> backward
-> clip_grad_norm_ -> AdamW.step -> zero_grad``. Prints median step times, tokens/s and the ratio
(goal: the core within 5% of the hand-written loop), and writes JSON.

    python -m benchmarks.core_overhead --device cpu --steps 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import twinkle_fn as tf
from twinkle_fn.data import pad_collate
from twinkle_fn.testing import random_features, tiny_config


def main(argv: list[str] | None = None) -> dict:
    """Run both loops and return (and print, and write) the results."""
    args = _parser().parse_args(argv)
    torch.manual_seed(0)
    device = torch.device(args.device)
    config = tiny_config(
        "qwen2",
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        vocab_size=args.vocab,
    )
    feats = random_features(
        args.batch, vocab_size=args.vocab, min_len=args.seq, max_len=args.seq, seed=0
    )
    batch = {k: v.to(device) for k, v in pad_collate(feats, pad_token_id=0).items()}
    tokens = int(batch["attention_mask"].sum())

    times = _time(
        {
            "torch loop": _torch_loop(config, device, batch, args.lr),
            "twinkle_fn": _core_loop(config, device, batch, args.lr),
        },
        args,
    )
    base = times["torch loop"]
    rows = {
        name: {
            "median_step_ms": 1e3 * t,
            "tokens_per_s": tokens / t,
            "ratio_vs_torch_loop": t / base,
        }
        for name, t in times.items()
    }
    result = {"device": str(device), "tokens_per_step": tokens, "args": vars(args), "rows": rows}
    _print(result)
    Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def _torch_loop(config, device, batch, lr) -> Callable[[], None]:
    model = tf.models.from_hf_config(config, seed=0, device=device).module
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, foreach=True)
    labels = batch["labels"]

    def step() -> None:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _core_loop(config, device, batch, lr) -> Callable[[], None]:
    model = tf.models.from_hf_config(config, seed=0, device=device)
    tx = tf.optim.chain(tf.optim.clip_by_global_norm(1.0), tf.optim.adamw(lr, weight_decay=0.0))
    holder = [tf.init(model, tx)]

    def step() -> None:
        grads, _ = tf.fwd_bwd(holder[0], batch)
        holder[0], _ = tf.step(holder[0], grads)

    return step


def _time(steps: dict[str, Callable[[], None]], args: argparse.Namespace) -> dict[str, float]:
    """Median seconds per step of each loop after warm-up, the device synchronised around each
    step. The loops take turns, one step each (who goes first alternating), so that a slow
    stretch of a shared machine lands on both alike rather than on whichever ran then."""
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    for _ in range(args.steps):
        for name in order:
            _sync(args.device)
            start = time.perf_counter()
            steps[name]()
            _sync(args.device)
            samples[name].append(time.perf_counter() - start)
        order.reverse()
    return {name: statistics.median(s) for name, s in samples.items()}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _print(result: dict) -> None:
    print(f"device {result['device']}, {result['tokens_per_step']} tokens per step")
    print(f"{'loop':<12} {'median ms':>10} {'tokens/s':>12} {'vs torch loop':>14}")
    for name, row in result["rows"].items():
        print(
            f"{name:<12} {row['median_step_ms']:>10.2f} {row['tokens_per_s']:>12.0f} "
            f"{row['ratio_vs_torch_loop']:>13.3f}x"
        )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--json", default="core_overhead.json")
    return p


if __name__ == "__main__":
    main()
