"""`benchmarks.one_gpu`'s ``load`` workload: the wall time to load a bf16 checkpoint onto the
device (``hf_from_pretrained``, or ``tf.models.from_pretrained`` on a backend) and to ``tf.init``
a LoRA state over it, each row reading the checkpoint's files from the page cache."""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

import twinkle_fn as tf
from benchmarks.one_gpu_rows import LORA, skipped
from benchmarks.report import device_name, print_json_row, versions, write_json
from benchmarks.timing import peak_gib, run_isolated, sync
from benchmarks.training import backend_world, twinkle_optimizer


def write_checkpoint(config: PretrainedConfig, directory: Path) -> int:
    """A random bf16 checkpoint of `config` in `directory` unless one is there; its bytes."""
    if not (directory / "config.json").is_file():
        torch.manual_seed(0)
        module = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        module.save_pretrained(directory)
        del module
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def _warm(directory: Path) -> None:
    """Read every file once, so that each row reads from the page cache alike."""
    for f in sorted(directory.glob("*.safetensors")):
        with f.open("rb", buffering=0) as fh:
            while fh.read(1 << 26):
                pass


def load_row(name: str, directory: Path, device: torch.device) -> dict[str, Any]:
    """Load the checkpoint in `directory` the way row `name` does, timing the load and the
    init; memory released after."""
    return skipped(name, device) or run_isolated(device, lambda: _load(name, directory, device))


def _load(name: str, directory: Path, device: torch.device) -> dict[str, Any]:
    backend = name.removeprefix("twinkle_")
    with backend_world(backend, device):
        sync(device)
        start = time.perf_counter()
        if name == "hf_from_pretrained":
            loaded: Any = AutoModelForCausalLM.from_pretrained(
                directory, dtype=torch.bfloat16, device_map=str(device)
            )
        else:
            loaded = tf.models.from_pretrained(directory, backend=backend, precision="bf16")
        sync(device)
        load_s = time.perf_counter() - start
        if name != "hf_from_pretrained":
            model = tf.lora.add_lora(loaded, dict(LORA))
            loaded = tf.init(model, twinkle_optimizer(backend))
        sync(device)
        total = time.perf_counter() - start
        peak = peak_gib(device)
        del loaded
    return {
        "status": "ok",
        "load_s": load_s,
        "init_s": total - load_s,
        "total_s": total,
        "peak_mem_gib": peak,
    }


def run_load(
    args: argparse.Namespace, config: PretrainedConfig, device: torch.device, rows: list[str]
) -> dict[str, Any]:
    """The ``load`` workload's `rows` on the checkpoint ``args.checkpoint`` (written first when
    it has none): printed, written to ``args.json`` after every row and returned."""
    directory = Path(args.checkpoint or f"/tmp/twinkle_{args.shape}_bf16")
    size = write_checkpoint(config, directory)
    _warm(directory)
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device_name": device_name(device),
        "versions": versions(),
        "workload": "load",
        "shape": args.shape,
        "checkpoint": str(directory),
        "checkpoint_gib": size / 2**30,
        "rows": {},
    }
    print(f"load {args.shape}: {size / 2**30:.2f} GiB in {directory} on {result['device_name']}")
    for name in rows:
        row = load_row(name, directory, device)
        if row["status"] == "ok":
            row["gb_per_s"] = size / 1e9 / row["total_s"]
        result["rows"][name] = row
        print_json_row(name, row)
        write_json(result, args.json)
    return result
