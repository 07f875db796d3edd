"""`twinkle train` / `twinkle rl` flags: their parsers (checked at parse time) and where each lands
in the run config."""

from __future__ import annotations

import argparse
from typing import Any

import yaml

import twinkle_fn as tf

# flag -> config key; a flag given on the command line overrides the config file.
FLAGS = {
    "model": "model.path",
    "data": "data.path",
    "steps": "schedule.steps",
    "batch_size": "data.batch_size",
    "micro_batches": "data.micro_batches",
    "lr": "optimizer.lr",
    "warmup_steps": "schedule.warmup_steps",
    "weight_decay": "optimizer.weight_decay",
    "max_length": "model.max_length",
    "num_samples": "data.num_samples",
    "precision": "precision",
    "seed": "seed",
    "mesh": "mesh",
    "output_dir": "output.dir",
    "backend": "backend",
    "lora": "lora",
    "resume": "resume",
    "save_steps": "cadence.save_steps",
    "keep_last": "cadence.keep_last",
    "eval_steps": "cadence.eval_steps",
}


def _nested(key: str, value: Any) -> dict[str, Any]:
    """``("a.b", v)`` -> ``{"a": {"b": v}}``."""
    *parents, leaf = key.split(".")
    node: dict[str, Any] = {leaf: value}
    for part in reversed(parents):
        node = {part: node}
    return node


def _mesh(text: str) -> tf.Mesh:
    """``"dp=2,tp=2"`` -> ``Mesh(dp=2, tp=2)``. Raises ``ValueError`` naming the text."""
    try:
        sizes = {k.strip(): int(v) for k, v in (part.split("=") for part in text.split(","))}
        return tf.Mesh(**sizes)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"mesh {text!r} is not a mesh; write sizes like fsdp=2 or dp=2,tp=2 ({e})"
        ) from e


def _mesh_flag(text: str) -> str:
    """`--mesh`: checked at parse time, kept as text (the config's form)."""
    try:
        _mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return text


def _lora(text: str) -> dict[str, Any]:
    """``"r=16,alpha=32,targets=all-linear"`` -> the ``lora`` block (keys checked later)."""
    try:
        return {k.strip(): yaml.safe_load(v) for k, v in (p.split("=", 1) for p in text.split(","))}
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"{text!r}: write key=value pairs, e.g. r=16,alpha=32,targets=all-linear"
        ) from e


def _nonnegative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value
