"""Timing training steps on one device: medians of synchronised steps, peak memory, and a row
measured with the device's memory released around it (or skipped, or its failure kept as its
result)."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from twinkle_fn import backends

Step = Callable[[], torch.Tensor]  # one training step; returns its mean loss (a device tensor)


class StepTiming(NamedTuple):
    """What `time_steps` measured: the median seconds per timed step, the median seconds until
    the step's call returned to the host (its launch work; close to ``seconds`` when the host,
    not the GPU, bounds the step), and the first and last losses."""

    seconds: float
    host_seconds: float
    first_loss: float
    last_loss: float


def time_steps(step: Step, warmup: int, steps: int, device: torch.device) -> StepTiming:
    """Run `warmup` untimed steps, then time `steps` ones, each bracketed by device
    synchronisations. The first warm-up step's loss is read on the host (warm-up is not timed)."""
    first = float(step())
    for _ in range(warmup - 1):
        step()
    samples, host = [], []
    loss = torch.tensor(first)
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        loss = step()
        host.append(time.perf_counter() - start)
        sync(device)
        samples.append(time.perf_counter() - start)
    return StepTiming(statistics.median(samples), statistics.median(host), first, float(loss))


def sync(device: torch.device) -> None:
    """Wait for the work queued on `device` (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Free what the last row left (compiled graphs, cached blocks) and reset the peak."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    """CUDA's peak allocated memory on `device` in GiB since its last reset; None off CUDA."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def allocated_gib(device: torch.device) -> float | None:
    """CUDA's memory allocated on `device` now, in GiB; None off CUDA."""
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None


def error_row(error: Exception, limit: int = 500) -> dict[str, Any]:
    """The result of a row that raised `error`: its type and message, cut to `limit` characters."""
    return {"status": "error", "error": f"{type(error).__name__}: {error}"[:limit]}


def run_isolated(device: torch.device, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`measure`'s row, or `error_row` of what it raised, with `device`'s memory released before
    and after it, so that neither the row before nor this one's leftovers count in a peak."""
    release(device)
    try:
        row = measure()
    except Exception as e:  # a failing row is a result (out of memory, a missing backend)
        row = error_row(e)
    release(device)
    return row


def skipped_row(
    name: str, device: torch.device, no_megatron: str = "no megatron backend in twinkle_fn.backends"
) -> dict[str, Any] | None:
    """Why row `name` does not run on `device`, as its result: a compiled row (``_compiled`` in
    its name) off a GPU, or a megatron row without that backend (`no_megatron` says so); None
    when it runs."""
    if "_compiled" in name and device.type != "cuda":
        return {"status": "skipped", "reason": "GPU only (compiling on a CPU takes minutes)"}
    if "megatron" in name and "megatron" not in backends.names():
        return {"status": "skipped", "reason": no_megatron}
    return None
