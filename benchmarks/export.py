"""Weights out to a colocated rollout engine: `tf.export_weights` against gathering a state dict.

One process, the transformers backend (or the megatron backend with ``--backend megatron``): a
randomly initialised model of the chosen shape (float32 master weights with bf16 compute on the
transformers backend, bf16 weights on megatron's, as the trainer holds them; plain SGD, so no
optimizer state takes memory) and a consumer, the same HF model in bf16 on the same device, as a colocated
engine holds it. Rows:

- ``export_stream``: every bucket of ``tf.export_weights(state, dtype=bf16)`` loaded into the
  consumer as it arrives (``load_state_dict(bucket, strict=False)``, what an engine's
  ``load_weights`` does);
- ``state_dict_device``: ``tf.unshard(state)`` (whole tensors), then one ``load_state_dict`` of
  all of them;
- ``state_dict_cpu``: the same through host memory (``get_state_dict()``'s CPU copy, then
  ``load_state_dict``), the path this project offered before the stream.

Each row reports GB/s (bytes of the exported bf16 weights / seconds, median of the timed
repeats), its time, and the peak device memory above what the trainer and the consumer hold
(what the row itself needs on top). The consumer's weights are checked against the trainer's
after every row.

    python -m benchmarks.export --shape qwen3-4b --json export.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

import twinkle_fn as tf
from benchmarks.cli import device_of
from benchmarks.report import device_name, versions, write_json
from benchmarks.shapes import QWEN3_SHAPES
from benchmarks.timing import sync

# `benchmarks.shapes.QWEN3_SHAPES` on transformers' Qwen3 defaults, not on `qwen3_config`'s
# (so the tiny one is untied)
SHAPES = MappingProxyType(
    {
        "tiny": QWEN3_SHAPES["tiny"],
        "qwen3-4b": {**QWEN3_SHAPES["qwen3-4b"], "tie_word_embeddings": True},
    }
)
ROWS = ("export_stream", "state_dict_device", "state_dict_cpu")
GB = 1e9


def config_of(shape: str) -> PretrainedConfig:
    """The HF ``Qwen3Config`` of `shape`. Raises ``ValueError`` for an unknown shape."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; use one of {', '.join(SHAPES)}")
    return AutoConfig.for_model("qwen3", **SHAPES[shape])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the rows, print a table and return (and write to ``--json``) the results."""
    args = _parser().parse_args(argv)
    device = device_of(args.device)
    config = config_of(args.shape)
    # the megatron backend builds its own model on the device; its HF module stays on the host
    home = device if args.backend == "transformers" else None
    model = tf.models.from_hf_config(
        config, seed=0, precision="bf16", device=home, backend=args.backend
    )
    state = tf.init(model, tf.optim.sgd(1e-5))  # no optimizer state: the weights are the point
    with device:  # built in place: a 4B model's random init on the host takes minutes
        consumer = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    nbytes = sum(t.numel() * 2 for bucket in tf.export_weights(state) for _, t in bucket)
    result: dict[str, Any] = {
        "shape": args.shape,
        "backend": args.backend,
        "device": str(device),
        "device_name": device_name(device),
        "bucket_bytes": args.bucket_mb << 20,
        "export_gb": nbytes / GB,
        "versions": versions(),
        "rows": {},
    }
    runs: dict[str, Callable[[], None]] = {
        "export_stream": lambda: _stream(state, consumer, args.bucket_mb << 20),
        "state_dict_device": lambda: _whole(state, consumer, None),
        "state_dict_cpu": lambda: _whole(state, consumer, torch.device("cpu")),
    }
    for name in args.rows:
        result["rows"][name] = _measure(runs[name], consumer, state, nbytes, args, device)
        write_json(result, args.json)
    _print(result)
    return result


def _stream(state: tf.TrainState, consumer: torch.nn.Module, bucket_bytes: int) -> None:
    for bucket in tf.export_weights(state, dtype=torch.bfloat16, bucket_bytes=bucket_bytes):
        consumer.load_state_dict(dict(bucket), strict=False)


def _whole(state: tf.TrainState, consumer: torch.nn.Module, via: torch.device | None) -> None:
    weights = tf.unshard(state)
    if via is not None:
        weights = {k: v.to(via) for k, v in weights.items()}
    consumer.load_state_dict(weights, strict=False)


def _measure(
    run: Callable[[], None],
    consumer: torch.nn.Module,
    state: tf.TrainState,
    nbytes: int,
    args: argparse.Namespace,
    device: torch.device,
) -> dict[str, Any]:
    times = []
    for i in range(args.warmup + args.repeats):
        _zero(consumer)
        sync(device)
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        run()
        sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    extra = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    seconds = statistics.median(times)
    return {
        "seconds": seconds,
        "gb_per_s": nbytes / GB / seconds,
        "extra_peak_gib": None if extra is None else extra / 2**30,
        "max_abs_diff": _max_diff(consumer, state),
    }


@torch.no_grad()
def _zero(module: torch.nn.Module) -> None:
    for p in module.parameters():
        p.zero_()


@torch.no_grad()
def _max_diff(consumer: torch.nn.Module, state: tf.TrainState) -> float:
    """The largest difference between the consumer's weights and the trainer's, in bf16."""
    own = consumer.state_dict()
    diffs = [
        (own[name].float() - tensor.to(own[name].device, torch.bfloat16).float()).abs().max()
        for bucket in tf.export_weights(state)
        for name, tensor in bucket
    ]
    return float(torch.stack(diffs).max())


def _print(result: dict[str, Any]) -> None:
    print(
        f"{result['shape']} ({result['export_gb']:.2f} GB of bf16 weights), {result['backend']} "
        f"backend, {result['device_name']}, buckets of {result['bucket_bytes'] >> 20} MiB"
    )
    print("GB/s = exported bf16 bytes / seconds (median)")
    print("row | GB/s | seconds | extra peak GiB | max |consumer - trainer|")
    for name, row in result["rows"].items():
        extra = "n/a" if row["extra_peak_gib"] is None else f"{row['extra_peak_gib']:.2f}"
        print(
            f"{name} | {row['gb_per_s']:.2f} | {row['seconds']:.3f} | {extra} | "
            f"{row['max_abs_diff']:.3g}"
        )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="qwen3-4b")
    p.add_argument("--backend", choices=("transformers", "megatron"), default="transformers")
    p.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--json", default="export.json")
    return p


if __name__ == "__main__":
    main()
