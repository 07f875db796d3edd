"""`twinkle train`'s checkpoints: periodic saves kept to the last N, resume, and stop signals.

Periodic checkpoints are ``<output>/checkpoints/step-<N>`` (`tf.checkpoint` directories, with
the data position in their ``extra``); the final one is ``<output>/checkpoint``. ``latest`` is
the complete one with the highest step among both.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

import twinkle_fn as tf
from twinkle_fn.distributed import rank, world_size

_STEP_DIR = re.compile(r"step-(\d+)")


def periodic_dir(output: Path, step: int) -> Path:
    """Where the periodic checkpoint of `step` goes."""
    return output / "checkpoints" / f"step-{step}"


def checkpoints(output: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints under `output` as (step, path), by step."""
    found = []
    for path in sorted((output / "checkpoints").glob("step-*")):
        match = _STEP_DIR.fullmatch(path.name)
        if match and tf.checkpoint.is_complete(path):
            found.append((int(match.group(1)), path))
    if tf.checkpoint.is_complete(output / "checkpoint"):
        step = tf.checkpoint.read_extra(output / "checkpoint").get("step")
        if isinstance(step, int):
            found.append((step, output / "checkpoint"))
    return sorted(found, key=lambda item: item[0])


def resume_path(resume: str | None, output: Path) -> Path | None:
    """The checkpoint directory `resume` names (``latest``: the newest under `output`).

    Raises ``ValueError`` naming the path when it holds no complete twinkle checkpoint, or
    naming `output` when ``latest`` finds none.
    """
    if resume is None:
        return None
    if resume == "latest":
        found = checkpoints(output)
        if not found:
            raise ValueError(
                f"--resume latest: no complete checkpoint under {output} (looked in "
                f"{output / 'checkpoints'} and {output / 'checkpoint'}); start without --resume "
                "or pass a checkpoint directory"
            )
        return found[-1][1]
    path = Path(resume)
    if not tf.checkpoint.is_complete(path):
        raise ValueError(
            f"--resume {path}: not a twinkle checkpoint (no complete save there: "
            f"{tf.checkpoint.MANIFEST} missing); pass a directory written by twinkle train, "
            "e.g. <output>/checkpoints/step-<N>, or --resume latest"
        )
    return path


def prune(output: Path, keep_last: int) -> None:
    """Remove all but the `keep_last` newest periodic checkpoints (rank 0 only)."""
    if rank() != 0:
        return
    periodic = [(s, p) for s, p in checkpoints(output) if p.parent.name == "checkpoints"]
    for _, path in periodic[: max(len(periodic) - keep_last, 0)]:
        shutil.rmtree(path)


class Stopped(Exception):
    """The run stopped on a signal after saving a checkpoint at step ``args[0]``."""


class StopSignals:
    """SIGINT / SIGTERM ask the run to stop after the current step (and save); a second
    signal exits at once with ``128 + signum``. A context manager restoring the old handlers."""

    def __init__(self) -> None:
        self.requested = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            os._exit(128 + signum)
        self.requested = True

    def agreed(self) -> bool:
        """Whether any rank was asked to stop (a collective on several ranks)."""
        flag = torch.tensor([int(self.requested)])
        if world_size() > 1:
            dist.all_reduce(flag)
        return bool(flag.item())
