"""What a benchmark run records besides its timings, and how it prints and writes its rows: the
package versions, the device's name, speed-ups between rows, table cells and the JSON file."""

from __future__ import annotations

import json
import platform
from collections.abc import Callable, Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import transformers

Row = dict[str, Any]


def versions() -> dict[str, str | None]:
    """Versions of Python and of the packages a result depends on (None when not installed)."""

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "megatron-core": version("megatron-core"),
        "flash-attn": version("flash-attn"),
        "transformer-engine": version("transformer-engine"),
    }


def device_name(device: torch.device) -> str:
    """The GPU's name of a CUDA `device`, else ``"cpu"``."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def add_ratios(rows: dict[str, Row], baselines: Sequence[str]) -> None:
    """Speed-ups (tokens/s over each of `baselines`') and peak memory over the compiled loop's
    (``hf_compiled``), written into each ok row as ``x_<baseline>`` and ``mem_vs_hf_compiled``
    (None where the reference did not run)."""
    for row in rows.values():
        if row["status"] != "ok":
            continue
        for base in baselines:
            ref = rows.get(base, {})
            ok = ref.get("status") == "ok"
            row[f"x_{base}"] = row["tokens_per_s"] / ref["tokens_per_s"] if ok else None
        ref = rows.get("hf_compiled", {})
        ok = ref.get("status") == "ok" and row["peak_mem_gib"] is not None
        row["mem_vs_hf_compiled"] = row["peak_mem_gib"] / ref["peak_mem_gib"] if ok else None


def fmt(
    value: float | None, spec: str, scale: float = 1.0, unit: str = "", none: str = "n/a"
) -> str:
    """`value` times `scale` formatted by `spec`, then `unit`; `none` for None."""
    return none if value is None else format(value * scale, spec) + unit


def not_ok(row: Row) -> str:
    """A row that did not run: its status and why (the error, or the reason it was skipped)."""
    return f"{row['status']}: {row.get('error') or row.get('reason')}"


def summary(row: Row, baselines: Sequence[str], extra: Sequence[str] = ()) -> str:
    """One line of `row`: tokens/s, step time, MFU, peak memory, the `extra` cells, the speed-up
    over each of `baselines` and the loss; `not_ok` for a row that did not run."""
    if row["status"] != "ok":
        return not_ok(row)
    cells = [
        f"{row['tokens_per_s']:.0f} tokens/s",
        f"{row['step_ms']:.1f} ms/step",
        f"MFU {fmt(row['mfu'], '.1f', 100.0, '%')}",
        f"peak {fmt(row['peak_mem_gib'], '.1f', unit=' GiB')}",
        *extra,
        *(f"x {base} {fmt(row[f'x_{base}'], '.2f')}" for base in baselines),
        f"loss {row['first_loss']:.3f} -> {row['last_loss']:.3f}",
    ]
    return ", ".join(cells)


def print_table(
    head: Sequence[str], rows: Iterable[tuple[str, Row]], cells: Callable[[str, Row], Sequence[str]]
) -> None:
    """Print `head` and a line per ``(name, row)`` of `rows`, cells separated by ``" | "``: the
    `cells` of an ok row, the name and `not_ok` of another."""
    print(" | ".join(head))
    for name, row in rows:
        print(" | ".join(cells(name, row)) if row["status"] == "ok" else f"{name} | {not_ok(row)}")


def print_json_row(name: str, row: Row, leave_out: str | None = None) -> None:
    """Print `row` as JSON after its name, without its `leave_out` key (a long one)."""
    print(f"{name}: {json.dumps({k: v for k, v in row.items() if k != leave_out})}", flush=True)


def write_json(result: dict[str, Any], path: str | None) -> None:
    """Write `result` to `path` as indented JSON; nothing when `path` is empty or None."""
    if path:
        Path(path).write_text(json.dumps(result, indent=2))
