"""fp8 rows against their bf16 rows in `benchmarks.one_gpu`: the ``fp8`` workload's speed-ups,
and the ``fp8_parity`` workload, every fp8 row's loss curve over ``--parity-steps`` steps of the
built-in arithmetic chat data beside the bf16 row of its backend and compilation."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import time
from typing import Any

from benchmarks.one_gpu_rows import PARITY_LR, PARITY_WARMUP, ROWS, OneGpuSetup, skipped
from benchmarks.report import device_name, print_json_row, versions, write_json
from benchmarks.timing import run_isolated

PARITY_MEAN = 10  # steps averaged into a final loss, and into each point the curves compare


def bf16_row(name: str) -> str | None:
    """The bf16 row an fp8 row `name` is compared with (its backend's, compiled alike); None
    for a row that is not an fp8 row."""
    backend_kind = name.split("_", 2)
    if len(backend_kind) < 3 or not backend_kind[2].startswith("fp8"):
        return None
    compiled = "_compiled" if name.endswith("_compiled") else ""
    return f"twinkle_{backend_kind[1]}_bf16{compiled}"


def add_speedups(rows: dict[str, dict[str, Any]]) -> None:
    """Write into each ok fp8 row ``x_bf16`` (its tokens/s over its `bf16_row`'s) and
    ``mem_vs_bf16`` (peak memory over that row's; None on a CPU), where that row ran."""
    for name, row in rows.items():
        ref = rows.get(bf16_row(name) or "")
        if row["status"] != "ok" or not ref or ref["status"] != "ok":
            continue
        row["x_bf16"] = row["tokens_per_s"] / ref["tokens_per_s"]
        mem = row["peak_mem_gib"], ref["peak_mem_gib"]
        row["mem_vs_bf16"] = None if None in mem else mem[0] / mem[1]


def parity_batches(steps: int, samples: int, seed: int = 0) -> tuple[dict[str, Any], ...]:
    """`steps` packed rows of `samples` built-in arithmetic chat samples each (character
    tokens: ids below 128, within every shape's vocabulary), all different."""
    from twinkle_fn.data import arithmetic_dataset, char_tokenizer, encode_rows, pack

    features = encode_rows(char_tokenizer(), arithmetic_dataset(steps * samples, seed))
    return tuple(pack(features[i * samples : (i + 1) * samples]) for i in range(steps))


def parity_row(name: str, setup: OneGpuSetup) -> dict[str, Any]:
    """Row `name` trained on each of ``setup.batches`` once: its loss curve and final loss (the
    mean of the last `PARITY_MEAN` steps), or why it was skipped or failed."""
    return skipped(name, setup.device) or run_isolated(setup.device, lambda: _train(name, setup))


def _train(name: str, setup: OneGpuSetup) -> dict[str, Any]:
    with ROWS[name](setup) as step:
        start = time.perf_counter()
        losses = [float(step()) for _ in setup.batches]
        seconds = time.perf_counter() - start
    tail = losses[-PARITY_MEAN:]
    return {
        "status": "ok",
        "seconds": seconds,
        "final_loss": sum(tail) / len(tail),
        "losses": losses,
    }


def add_parity_diffs(rows: dict[str, dict[str, Any]]) -> None:
    """Write into each ok fp8 row ``loss_diff_vs_bf16`` (its final loss minus that of the bf16
    row of its backend and compilation) and ``max_loss_diff`` (the largest absolute difference
    of their `PARITY_MEAN`-step means along the curves), where that bf16 row ran."""
    for name, row in rows.items():
        ref = rows.get(bf16_row(name) or "")
        if row["status"] != "ok" or not ref or ref["status"] != "ok":
            continue
        row["loss_diff_vs_bf16"] = row["final_loss"] - ref["final_loss"]
        means = [_means(row["losses"]), _means(ref["losses"])]
        row["max_loss_diff"] = max(abs(a - b) for a, b in zip(*means, strict=True))


def _means(losses: list[float]) -> list[float]:
    n = min(PARITY_MEAN, len(losses))
    return [sum(losses[i : i + n]) / n for i in range(len(losses) - n + 1)]


def run_parity(args: argparse.Namespace, setup: OneGpuSetup, rows: list[str]) -> dict[str, Any]:
    """The ``fp8_parity`` workload's `rows`, every row on the same batches: printed, written to
    ``args.json`` after every row and returned."""
    batches = parity_batches(args.parity_steps, args.parity_samples)
    setup = dataclasses.replace(setup, batches=batches)
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device_name": device_name(setup.device),
        "versions": versions(),
        "workload": "fp8_parity",
        "shape": args.shape,
        "steps": args.parity_steps,
        "samples_per_step": args.parity_samples,
        "tokens_per_step": sum(int(b["input_ids"].numel()) for b in batches) / len(batches),
        "lr": PARITY_LR,
        "warmup_steps": min(PARITY_WARMUP, args.parity_steps - 1),
        "rows": {},
    }
    print(f"fp8_parity {args.shape}: {args.parity_steps} steps on {result['device_name']}")
    for name in rows:
        result["rows"][name] = parity_row(name, setup)
        add_parity_diffs(result["rows"])
        print_json_row(name, result["rows"][name], leave_out="losses")
        write_json(result, args.json)
    return result
