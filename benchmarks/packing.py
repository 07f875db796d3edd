"""Training throughput on packed rows: twinkle_fn's varlen attention beside a plain loop.

Samples of varied lengths packed back to back into one row (`twinkle_fn.data.pack`, what
``twinkle train`` feeds), the same Qwen2.5-shaped random-init model, bf16 autocast over fp32
master weights, AdamW and clipping as in `benchmarks.throughput`:

- ``hf_loop``: a plain transformers loop on SDPA given the packed ``position_ids`` and no mask:
  transformers finds the samples from the positions and builds a ``[T, T]`` block mask (the
  plain loop's way without flash-attn);
- ``hf_compiled``: the same with ``torch.compile`` of the whole model (GPU only);
- ``twinkle_fsdp`` / ``twinkle_fsdp_compiled``: ``tf.fwd_bwd`` + ``tf.step`` on the
  transformers backend (each decoder layer compiled in the second; GPU only), whose packed rows
  take a varlen kernel on CUDA (`twinkle_fn.varlen_attention`);
- ``twinkle_megatron`` / ``twinkle_megatron_compiled``: the same on the megatron backend (THD).

Each row warms up, then takes the median of timed steps with the device synchronised around
each. It prints tokens/s, MFU (formula printed: attention counted per sample), peak memory and
the ratio to each baseline, and writes JSON.

    python -m benchmarks.packing --shape qwen2.5-0.5b --tokens 16384 --max-len 4096
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from benchmarks.cli import device_of, positive_int
from benchmarks.flops import default_peak, matmul_params, mfu
from benchmarks.report import add_ratios, device_name, summary, versions
from benchmarks.shapes import QWEN25_SHAPES, qwen25_config
from benchmarks.timing import Step, peak_gib, run_isolated, skipped_row, time_steps
from benchmarks.training import Setup, backend_world, hf_step, twinkle_step
from twinkle_fn.data import pack

ROWS = (
    "hf_loop",
    "hf_compiled",
    "twinkle_fsdp",
    "twinkle_fsdp_compiled",
    "twinkle_megatron",
    "twinkle_megatron_compiled",
)
BASELINES = ("hf_loop", "hf_compiled")
Builder = Callable[[Setup, dict[str, Any]], contextlib.AbstractContextManager[Step]]
MFU_FORMULA = (
    "MFU = tokens/s x (6 x matmul params incl. lm_head + 6 x layers x hidden x "
    "sum(len_i^2) / tokens) / peak"
)


def sample_lengths(tokens: int, max_len: int, seed: int = 0) -> list[int]:
    """Sample lengths drawn uniformly from ``[max_len // 8, max_len]`` (at least 1) until they
    fill `tokens` exactly (the last one cut short). Raises ``ValueError`` unless both are > 0."""
    if tokens < 1 or max_len < 1:
        raise ValueError(f"tokens and max_len must be positive, got {tokens} and {max_len}")
    rng = random.Random(seed)
    lengths: list[int] = []
    while (left := tokens - sum(lengths)) > 0:
        lengths.append(min(left, rng.randint(max(1, max_len // 8), max_len)))
    return lengths


def packed_batch(lengths: list[int], vocab_size: int, seed: int = 0) -> dict[str, Any]:
    """One packed row of random-token samples of `lengths`, each trained on its next tokens."""
    gen = torch.Generator().manual_seed(seed)
    feats = []
    for n in lengths:
        ids = torch.randint(0, vocab_size, (n,), generator=gen).tolist()
        feats.append({"input_ids": ids, "labels": [*ids[1:], -100]})
    return pack(feats)


def flops_per_token(config: PretrainedConfig, lengths: list[int]) -> float:
    """`MFU_FORMULA`'s FLOPs per token: with equal lengths S, throughput's ``6 N + 6 L H S``."""
    attention = sum(n * n for n in lengths) / sum(lengths)
    layers, hidden = config.num_hidden_layers, config.hidden_size
    return 6 * matmul_params(config) + 6 * layers * hidden * attention


def main(argv: list[str] | None = None) -> dict:
    """Run the selected rows and return (and print, and write) the results."""
    args = _parser().parse_args(argv)
    device = device_of(args.device)
    config = qwen25_config(args.shape)
    lengths = sample_lengths(args.tokens, args.max_len)
    batch = packed_batch(lengths, config.vocab_size)
    setup = Setup(config, batch["input_ids"].to(device), device, "model")
    fpt = flops_per_token(config, lengths)
    peak = default_peak(device)
    result: dict[str, Any] = {
        "device_name": device_name(device),
        "versions": versions(),
        "shape": args.shape,
        "lengths": lengths,
        "tokens_per_step": args.tokens,
        "flops_per_token": fpt,
        "peak_flops": peak,
        "mfu_formula": MFU_FORMULA,
        "rows": {},
    }
    print(
        f"{args.shape}, one packed row of {len(lengths)} samples ({args.tokens} tokens, longest "
        f"{max(lengths)}) on {result['device_name']}; {MFU_FORMULA}, {fpt / 1e9:.3f} GFLOP/token"
    )
    for name in args.rows:
        row = _run_row(name, setup, batch, args.warmup, args.steps)
        if row["status"] == "ok":
            row["mfu"] = mfu(row["tokens_per_s"], fpt, peak)
        result["rows"][name] = row
        add_ratios(result["rows"], BASELINES)
        print(f"{name}: {summary(row, BASELINES)}", flush=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def _run_row(
    name: str, setup: Setup, batch: dict[str, Any], warmup: int, steps: int
) -> dict[str, Any]:
    """One row's measurement, or why it was skipped or failed."""
    return skipped_row(name, setup.device) or run_isolated(
        setup.device, lambda: _measure(name, setup, batch, warmup, steps)
    )


def _measure(
    name: str, setup: Setup, batch: dict[str, Any], warmup: int, steps: int
) -> dict[str, Any]:
    with _ROW_BUILDERS[name](setup, batch) as step:
        timing = time_steps(step, warmup, steps, setup.device)
        peak = peak_gib(setup.device)
    return {
        "status": "ok",
        "step_ms": 1e3 * timing.seconds,
        "tokens_per_s": setup.input_ids.numel() / timing.seconds,
        "peak_mem_gib": peak,
        "first_loss": timing.first_loss,
        "last_loss": timing.last_loss,
    }


def _hf_step(setup: Setup, batch: dict[str, Any], compiled: bool) -> Step:
    """The plain loop on the packed row: positions passed, mask left to transformers."""
    ids, positions, labels = (
        batch[k].to(setup.device) for k in ("input_ids", "position_ids", "labels")
    )
    # the labels are shifted per sample already: shift_labels keeps HF from shifting
    return hf_step(
        setup,
        "model" if compiled else None,
        input_ids=ids,
        position_ids=positions,
        labels=labels,
        shift_labels=labels,
    )


def _twinkle(backend: str, compiled: bool) -> Builder:
    @contextlib.contextmanager
    def build(setup: Setup, batch: dict[str, Any]) -> Iterator[Step]:
        options = {"compile_layers": True} if compiled else None
        with backend_world(backend, setup.device):
            yield twinkle_step(setup, backend, options, batches=[batch])

    return build


def _hf(compiled: bool) -> Builder:
    @contextlib.contextmanager
    def build(setup: Setup, batch: dict[str, Any]) -> Iterator[Step]:
        yield _hf_step(setup, batch, compiled)

    return build


_ROW_BUILDERS: dict[str, Builder] = {
    "hf_loop": _hf(compiled=False),
    "hf_compiled": _hf(compiled=True),
    "twinkle_fsdp": _twinkle("fsdp", compiled=False),
    "twinkle_fsdp_compiled": _twinkle("fsdp", compiled=True),
    "twinkle_megatron": _twinkle("megatron", compiled=False),
    "twinkle_megatron_compiled": _twinkle("megatron", compiled=True),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=tuple(QWEN25_SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--tokens", type=positive_int, default=16384)
    p.add_argument("--max-len", type=positive_int, default=4096)
    p.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    p.add_argument("--steps", type=positive_int, default=6)
    p.add_argument("--warmup", type=positive_int, default=3)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--json", default="packing.json")
    return p


if __name__ == "__main__":
    main()
