"""The trainer's side of one GRPO iteration on one device, beside a supervised step.

One randomly initialised Qwen2.5-shaped model (configs built by hand, no download), bf16 compute
over fp32 master weights on the transformers backend (bf16 weights with fp32 master copies on
megatron's, with ``--backend megatron``), AdamW with global-norm clipping as in
`benchmarks.throughput`. Every row runs on the same ``[batch, seq]`` random tokens: each row is
a prompt (the first half, unsupervised) and a completion (the second half, supervised), as a
rollout batch is. Rows, in the order an RL iteration runs them:

- ``old_logps``: ``tf.token_logps`` over the batch (no gradient): the old policy's per-token
  log-probabilities (the reference model's cost the same);
- ``sft_step``: ``tf.fwd_bwd`` + ``tf.step`` with the cross entropy (the fused lm_head path):
  the baseline;
- ``grpo_step``: the same with ``tf.losses.ppo_loss(epsilon=0.2, epsilon_high=0.28,
  beta=0.04)`` (k3 KL to the reference), reading per-token ``advantages``, ``old_logps`` and
  ``ref_logps``;
- ``grpo_entropy_step``: ``grpo_step`` with an entropy bonus (``entropy_coef=0.01``): the
  token entropy needs the whole row of logits;
- ``weight_sync``: ``tf.export_weights(state, dtype=bf16)`` loaded bucket by bucket into the
  rollout engine's copy (the same HF model in bf16 on the same device).

Steps report tokens/s (``batch * seq`` tokens), MFU and the ratio to ``sft_step``; the forward
row counts a third of a training step's FLOPs. ``weight_sync`` reports GB/s of exported bf16
bytes. Every row reports the device's peak allocated memory during the row.

    python -m benchmarks.rl_step --shape qwen2.5-0.5b --seq 2048 --batch 8 --json rl.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoModelForCausalLM

import twinkle_fn as tf
from benchmarks.cli import device_of, positive_int
from benchmarks.flops import MFU_FORMULA as TRAIN_MFU_FORMULA
from benchmarks.flops import default_peak, flops_per_token, mfu
from benchmarks.report import device_name, fmt, versions, write_json
from benchmarks.shapes import QWEN25_SHAPES, qwen25_config
from benchmarks.timing import peak_gib, release, sync
from benchmarks.training import backend_world, host_batch, padded_batch, twinkle_optimizer

ROWS = ("old_logps", "sft_step", "grpo_step", "grpo_entropy_step", "weight_sync")
STEP_ROWS = ("sft_step", "grpo_step", "grpo_entropy_step")
MFU_FORMULA = (
    f"{TRAIN_MFU_FORMULA}; a forward-only row counts a third of it (2 N + 2 L H S per token)"
)
GB = 1e9


def rl_batch(ids: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
    """`benchmarks.training.padded_batch` of `ids` ``[batch, seq]`` with the prompt half's
    labels ignored, a per-sample advantage broadcast to its tokens, and ``old_logps`` /
    ``ref_logps`` placeholders (``-log vocab``-scale numbers; `main` overwrites ``old_logps``
    with the model's own)."""
    batch = padded_batch(ids)
    rows, seq = ids.shape
    batch["labels"][:, : seq // 2] = -100
    gen = torch.Generator().manual_seed(seed)
    advantages = torch.randn(rows, 1, generator=gen).expand(rows, seq)  # [batch, seq]
    noise = 0.05 * torch.randn(rows, seq, generator=gen)  # [batch, seq]
    batch["advantages"] = advantages.contiguous()
    batch["old_logps"] = torch.full((rows, seq), -12.0)
    batch["ref_logps"] = batch["old_logps"] + noise
    return batch


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the rows, print a table and return (and write to ``--json``) the results."""
    args = _parser().parse_args(argv)
    device = device_of(args.device)
    config = qwen25_config(args.shape)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=_gen(0))
    peak = args.peak_flops or default_peak(device)
    result: dict[str, Any] = {
        "shape": args.shape,
        "backend": args.backend,
        "seq": args.seq,
        "batch": args.batch,
        "device_name": device_name(device),
        "flops_per_token": flops_per_token(config, args.seq),
        "peak_flops": peak,
        "mfu_formula": MFU_FORMULA,
        "versions": versions(),
        "rows": {},
    }
    with backend_world(args.backend, device):
        holder = [_state(config, args.backend, device)]
        batch = host_batch(rl_batch(ids), device)
        runs = _runs(holder, batch, config, device, args)
        for name in args.rows:
            release(device)
            try:
                result["rows"][name] = _measure(name, runs[name], args, device)
            except torch.OutOfMemoryError as e:  # a result (the row does not fit), not a crash
                result["rows"][name] = {"error": f"OutOfMemoryError: {e}"[:300]}
            write_json(result, args.json)
    _add_ratios(result)
    write_json(result, args.json)
    _print(result)
    return result


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _state(config: Any, backend: str, device: torch.device) -> tf.TrainState:
    # the megatron backend builds its own model on the device; its HF module stays on the host
    home = device if backend == "transformers" else torch.device("cpu")
    with torch.device(home):
        model = tf.models.from_hf_config(
            config, backend=backend, precision="bf16", device=home, seed=0
        )
    return tf.init(model, twinkle_optimizer(backend))


def _runs(
    holder: list[tf.TrainState],
    batch: dict[str, torch.Tensor],
    config: Any,
    device: torch.device,
    args: argparse.Namespace,
) -> dict[str, Callable[[], Any]]:
    # The policy's own log-probs make the ratio start at 1, as in a real first PPO epoch.
    batch["old_logps"] = tf.token_logps(holder[0], batch)["logps"].to(batch["old_logps"])
    with device:
        engine = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    grpo = tf.losses.ppo_loss(0.2, 0.28, beta=0.04)
    entropy = tf.losses.ppo_loss(0.2, 0.28, beta=0.04, entropy_coef=0.01)

    def train(loss: tf.losses.TokenLoss | None) -> Callable[[], torch.Tensor]:
        def step() -> torch.Tensor:
            grads, _ = tf.fwd_bwd(holder[0], batch, loss=loss)
            holder[0], info = tf.step(holder[0], grads)
            return info["loss"]

        return step

    def weight_sync() -> int:
        nbytes = 0
        for bucket in tf.export_weights(holder[0], dtype=torch.bfloat16):
            engine.load_state_dict(dict(bucket), strict=False)
            nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
        return nbytes

    return {
        "old_logps": lambda: tf.token_logps(holder[0], batch)["logps"],
        "sft_step": train(None),
        "grpo_step": train(grpo),
        "grpo_entropy_step": train(entropy),
        "weight_sync": weight_sync,
    }


def _measure(
    name: str, run: Callable[[], Any], args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    times = []
    for i in range(args.warmup + args.steps):
        sync(device)
        start = time.perf_counter()
        out = run()
        sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    row: dict[str, Any] = {"seconds": seconds, "peak_mem_gib": peak_gib(device)}
    if name == "weight_sync":
        return {**row, "gb_per_s": out / GB / seconds}
    row["tokens_per_s"] = args.batch * args.seq / seconds
    return {**row, "output_mean": float(out.float().mean())}


def _add_ratios(result: dict[str, Any]) -> None:
    """MFU of every token row, and each step row's tokens/s over ``sft_step``'s."""
    rows, peak, per_token = result["rows"], result["peak_flops"], result["flops_per_token"]
    base = rows.get("sft_step", {}).get("tokens_per_s")
    for name, row in rows.items():
        if "tokens_per_s" not in row:
            continue
        flops = per_token / 3 if name == "old_logps" else per_token
        row["mfu"] = mfu(row["tokens_per_s"], flops, peak)
        row["x_sft_step"] = row["tokens_per_s"] / base if base and name in STEP_ROWS else None


def _print(result: dict[str, Any]) -> None:
    print(
        f"{result['shape']}, seq {result['seq']}, batch {result['batch']}, "
        f"{result['backend']} backend, on {result['device_name']}; "
        f"versions {json.dumps(result['versions'])}"
    )
    print(f"{result['mfu_formula']}; {result['flops_per_token'] / 1e9:.3f} GFLOP/token")
    print("row | tokens/s | GB/s | MFU | x sft_step | ms | peak GiB")
    for name, row in result["rows"].items():
        if "error" in row:
            print(f"{name} | {row['error']}")
            continue
        cells = (
            name,
            fmt(row.get("tokens_per_s"), ".0f"),
            fmt(row.get("gb_per_s"), ".2f"),
            fmt(row.get("mfu"), ".1f", 100.0, "%"),
            fmt(row.get("x_sft_step"), ".3f"),
            fmt(row["seconds"], ".1f", 1e3),
            fmt(row["peak_mem_gib"], ".1f"),
        )
        print(" | ".join(cells))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=tuple(QWEN25_SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--backend", choices=("transformers", "megatron"), default="transformers")
    p.add_argument("--seq", type=positive_int, default=2048)
    p.add_argument("--batch", type=positive_int, default=8)
    p.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    p.add_argument("--steps", type=positive_int, default=10)
    p.add_argument("--warmup", type=positive_int, default=3)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--peak-flops", type=float, default=None, help="default: 989e12 on H100/H200")
    p.add_argument("--json", default=None)
    return p


if __name__ == "__main__":
    main()
