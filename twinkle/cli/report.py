"""The training job's human-facing output: a summary table and a loss-curve PNG."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from rich.console import Console
from rich.table import Table


def plot_losses(
    losses: list[float], heldout_before: float, heldout_after: float, path: Path
) -> Path:
    """Write the per-step training loss and the held-out loss before/after to a PNG at `path`."""
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(range(1, len(losses) + 1), losses, label="train loss (per step)", linewidth=1)
    ax.scatter(
        [0, len(losses)],
        [heldout_before, heldout_after],
        color="C3",
        zorder=3,
        label="held-out loss",
    )
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def print_summary(summary: Any, title: str = "twinkle train: summary") -> None:
    """Print `summary` (a dataclass) as a two-column table."""
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in asdict(summary).items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    Console().print(table)
