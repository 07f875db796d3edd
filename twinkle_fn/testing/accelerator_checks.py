"""Test helpers for paths that need an accelerator's features: Triton kernels run under the CPU
interpreter (`run_triton_interpreted`), a float8 run's losses bounded by float8 rounding
(`assert_within_float8_rounding`), and CUDA code that must not make the host wait
(`no_host_sync`).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence

import torch


def run_triton_interpreted(code: str, *args: str) -> None:
    """Run Python `code` (with `args` as ``sys.argv[1:]``) in a fresh process under Triton's CPU
    interpreter, so a kernel's logic is tested without a GPU.

    A fresh process because ``TRITON_INTERPRET`` must be set before triton is first imported.
    Raises ``AssertionError`` with the end of the child's stderr if it fails.
    """
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=os.environ | {"TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def assert_within_float8_rounding(reference: Sequence[float], losses: Sequence[float]) -> None:
    """Check a float8 run's per-step `losses` against the float32 run's `reference`: each step
    within 1% relative (float8 rounding of the GEMM operands, as the fp8 tests measure it), and
    some step more than 1e-6 apart (more than float32 rounding: the float8 path ran).

    Raises ``AssertionError`` naming the step when a bound fails, ``ValueError`` when the runs
    have different lengths.
    """
    for step, (a, b) in enumerate(zip(reference, losses, strict=True)):
        assert abs(a - b) <= 1e-2 * abs(a), f"step {step}: loss {b}, float32 {a}: over 1% apart"
    gap = max(abs(a - b) for a, b in zip(reference, losses, strict=True))
    assert gap > 1e-6, f"the losses are {gap} apart at most: the float8 path did not run"


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Within the block, a CUDA call that makes the host wait for the device raises
    ``RuntimeError`` (``torch.cuda.set_sync_debug_mode("error")``); the device's queue is
    drained first, so only the block's own waits count. CUDA only."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)
