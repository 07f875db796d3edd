"""Where a training step's GPU time goes: kernel time by kind, idle time and exposed NCCL time.

``python -m benchmarks.profile_summary TRACE [--steps N]`` prints the summary of a trace a
benchmark kept (``--trace``; `N` steps in it, 2 as `profile_steps` records).

`profile_steps(step, n)` runs `step` `n` times under ``torch.profiler`` (CUDA kernels only) and
summarises the trace per step:

- ``wall_ms``: from the first kernel's start to the last kernel's end, over `n`;
- ``busy``: the share of ``wall_ms`` during which some kernel ran (1 - busy is the GPU waiting
  for the host: launch overhead, host syncs, Python);
- ``exposed_comm_ms``: time when an NCCL kernel ran and no compute kernel did (a kernel waiting
  for its peer counts: it is time this rank could not compute);
- ``overlapped``: of the NCCL kernels' time, the share during which a compute kernel also ran;
- ``kernels_ms``: summed kernel time per kind (`KINDS`), which may exceed ``wall_ms`` where
  streams overlap;
- ``exposed_by_kernel``: ``exposed_comm_ms`` split by NCCL kernel name (which collective waits);
- ``gaps``: the longest stretches with no kernel running (``at_ms`` from the first kernel,
  ``ms``, and the kernels either side): where the GPU waits for the host;
- ``top_kernels``: the kernel names with the most summed time, ms per step.
"""

from __future__ import annotations

import gzip
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

Span = tuple[float, float]

# (kind, substrings of the kernel name, lower case); the first match wins, "other" otherwise.
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "splitk")),
    ("optimizer", ("multi_tensor_apply", "foreach", "fused_adam", "_adamw_kernel")),
    ("triton", ("triton",)),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
    ("reduce", ("reduce",)),
    ("copy", ("copy", "memcpy", "memset", "cat", "fill")),
)


def kind_of(kernel: str) -> str:
    """The `KINDS` entry whose substrings `kernel`'s name contains, else ``"other"``."""
    name = kernel.lower()
    for kind, keys in KINDS:
        if any(k in name for k in keys):
            return kind
    return "other"


def profile_steps(
    step: Callable[[], Any], n: int = 2, trace: str | Path | None = None
) -> dict[str, Any]:
    """Run `step` `n` times under the profiler and summarise its CUDA kernels per step; with
    `trace`, also keep the chrome trace there (gzipped JSON, for chrome://tracing or Perfetto)."""
    from torch.profiler import ProfilerActivity, profile

    # Host events only for a kept trace: they show where the CPU falls behind the GPU.
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if trace else [])
    with profile(activities=activities) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(str(Path(tmp, "trace.json.gz")))
        raw = Path(tmp, "trace.json.gz").read_bytes()
    if trace is not None:
        Path(trace).write_bytes(raw)
    return summarise(kernel_events(raw), n)


def kernel_events(raw: bytes) -> list[dict[str, Any]]:
    """The CUDA kernel events (``name``, ``ts``, ``dur`` in microseconds) of a gzipped chrome
    trace's bytes, as `profile_steps` keeps them."""
    events = json.loads(gzip.decompress(raw))["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]


def host_ops(step: Callable[[], Any], n: int = 1, top: int = 12) -> list[dict[str, Any]]:
    """Where the host's time goes: the `top` operators of `n` runs of `step` by self CPU time,
    each ``{"name", "self_ms", "calls"}`` per step (under the profiler, which slows each call)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return [
        {"name": e.key, "self_ms": e.self_cpu_time_total / (1e3 * n), "calls": e.count / n}
        for e in ops
    ]


def summarise(kernels: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """The summary of `profile_steps` from chrome-trace kernel events (``name``, ``ts``, ``dur``
    in microseconds) covering `n` steps."""
    if not kernels:
        return {"wall_ms": 0.0, "busy": 0.0, "exposed_comm_ms": 0.0, "overlapped": 0.0}
    kernels = sorted(kernels, key=lambda e: e["ts"])
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    is_comm = ["nccl" in e["name"].lower() for e in kernels]
    comm = union([s for s, c in zip(spans, is_comm, strict=True) if c])
    compute = union([s for s, c in zip(spans, is_comm, strict=True) if not c])
    comm_us = length(comm)
    both_us = intersection(comm, compute)
    wall_us = max(b for _, b in spans) - min(a for a, _ in spans)
    per_kind: dict[str, float] = {}
    for e in kernels:
        kind = kind_of(e["name"])
        per_kind[kind] = per_kind.get(kind, 0.0) + e["dur"] / (1e3 * n)
    return {
        "wall_ms": wall_us / (1e3 * n),
        "busy": length(union(spans)) / wall_us if wall_us else 0.0,
        "comm_ms": comm_us / (1e3 * n),
        "exposed_comm_ms": (comm_us - both_us) / (1e3 * n),
        "overlapped": both_us / comm_us if comm_us else 0.0,
        "kernels_ms": dict(sorted(per_kind.items(), key=lambda kv: -kv[1])),
        "exposed_by_kernel": _exposed_by_kernel(kernels, is_comm, compute, n),
        "gaps": _gaps(kernels),
        "top_kernels": _top_kernels(kernels, n),
    }


def _top_kernels(kernels: list[dict[str, Any]], n: int, top: int = 10) -> dict[str, float]:
    """ms per step of the `top` kernel names with the most summed time, most first."""
    per_name: dict[str, float] = {}
    for e in kernels:
        per_name[e["name"]] = per_name.get(e["name"], 0.0) + e["dur"] / (1e3 * n)
    return dict(sorted(per_name.items(), key=lambda kv: -kv[1])[:top])


def _exposed_by_kernel(
    kernels: list[dict[str, Any]], is_comm: list[bool], compute: list[Span], n: int
) -> dict[str, float]:
    """ms per step of each NCCL kernel name's time with no compute kernel running."""
    exposed: dict[str, float] = {}
    for e, c in zip(kernels, is_comm, strict=True):
        if c:
            span = (e["ts"], e["ts"] + e["dur"])
            alone = e["dur"] - intersection([span], compute)
            exposed[e["name"]] = exposed.get(e["name"], 0.0) + alone / (1e3 * n)
    return dict(sorted(exposed.items(), key=lambda kv: -kv[1]))


def _gaps(kernels: list[dict[str, Any]], top: int = 4) -> list[dict[str, Any]]:
    """The `top` longest idle stretches of `kernels` (sorted by start), longest first."""
    start = kernels[0]["ts"]
    found, end, last = [], start, kernels[0]
    for e in kernels:
        if e["ts"] > end:
            at = (end - start) / 1e3
            found.append(
                {
                    "at_ms": at,
                    "ms": (e["ts"] - end) / 1e3,
                    "after": last["name"],
                    "before": e["name"],
                }
            )
        if e["ts"] + e["dur"] >= end:
            end, last = e["ts"] + e["dur"], e
    return sorted(found, key=lambda g: -g["ms"])[:top]


def format_summary(summary: dict[str, Any]) -> str:
    """Wall, busy share, exposed NCCL and the kinds' kernel ms per step; then, one line each,
    the collectives that waited longest exposed and the longest idle gaps."""
    kinds = ", ".join(f"{k} {v:.1f}" for k, v in summary.get("kernels_ms", {}).items())
    lines = [
        f"{summary['wall_ms']:.1f} ms/step on the GPU, busy {100 * summary['busy']:.0f}%, "
        f"exposed nccl {summary['exposed_comm_ms']:.1f} ms; kernels ms/step: {kinds}"
    ]
    exposed = [(k, v) for k, v in summary.get("exposed_by_kernel", {}).items() if v >= 0.05]
    if exposed:
        lines.append("exposed: " + ", ".join(f"{k[:60]} {v:.2f} ms" for k, v in exposed[:4]))
    for name, ms in summary.get("top_kernels", {}).items():
        lines.append(f"kernel {ms:7.2f} ms: {name[:110]}")
    for g in summary.get("gaps", []):
        lines.append(
            f"idle {g['ms']:.2f} ms at {g['at_ms']:.1f} ms: after {g['after'][:50]}, "
            f"before {g['before'][:50]}"
        )
    return "\n  ".join(lines)


def union(spans: list[Span]) -> list[Span]:
    """`spans` merged into sorted, disjoint spans."""
    merged: list[Span] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def length(spans: list[Span]) -> float:
    """Total length of disjoint `spans`."""
    return sum(b - a for a, b in spans)


def intersection(xs: list[Span], ys: list[Span]) -> float:
    """Total length of the overlap of two sorted, disjoint span lists."""
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Print and return the summary of a kept trace (see the module docstring)."""
    import argparse

    parser = argparse.ArgumentParser(description="summarise a kept profiler trace")
    parser.add_argument("trace", type=Path, help="a gzipped chrome trace (<row>.json.gz)")
    parser.add_argument("--steps", type=int, default=2, help="training steps in the trace")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    summary = summarise(kernel_events(args.trace.read_bytes()), args.steps)
    print(format_summary(summary))
    return summary


if __name__ == "__main__":
    main()
