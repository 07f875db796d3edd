"""Parity and scaling across GPUs (issue 7): every parallel mesh against one GPU, in one command.

One run launches ``torchrun`` worlds (a world per process count, and per speed row, keeps
megatron-core's global state and NCCL communicators of one measurement away from the next):

1. **parity reference**, one process: a few bf16 training steps of each small model alone;
2. beside it, **parity meshes**, ``--nproc`` processes: the same steps on every mesh of ``--meshes``
   (default: those of ``--nproc`` ranks. Two: transformers backend dp2, fsdp2, tp2; megatron
   backend tp2, pp2, cp2, dp2 with the distributed optimizer, and ep2 on a small Qwen3-MoE.
   Four (issue 8): fsdp4, dp2 x fsdp2; megatron tp2 x pp2, dp2 x tp2, and ep4, ep2 x tp2 on the
   MoE with 8 experts), each rank on its data slice of the same global batches; every step's
   loss is compared with the reference's;
3. **speed on one process** (the one-GPU rows at once, each on its own GPU) and 4. **speed on
   ``--nproc``**, a world per row: tokens/s, MFU and peak memory of a Qwen2.5-shaped model
   (``--shape``, ``--seq``; ``--micro-batch`` rows per data rank); the host's share of a step
   (``host ms``: until the step's call returns; near ``step ms``, the host bounds the step, and
   ``--host-ops N`` lists its costliest operators); and a profile of two steps that says how
   much of the communication kernels' time ran while a compute kernel was running (the overlap).

Precision is bf16 compute; the transformers backend keeps fp32 master weights, the megatron
backend bf16 weights with fp32 main copies in its distributed optimizer. A mesh's relative loss
difference passes when every step is within ``--loss-rtol`` (default 2e-2) of the reference:
bf16 keeps 8 bits of mantissa (relative rounding 2^-9 = 2e-3 per op), and a mesh changes the order
of the sums in matmuls, norms and gradient reductions, so per-token log-probs move by a few
roundings; the loss averages thousands of tokens but the steps compound the differences.

    python -m benchmarks.multi_gpu --nproc 2 --json multi_gpu.json

NVLink multicast stays off (the device tool's rule): the launcher sets ``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NVSHMEM_DISABLE_NVLS=1`` for every worker. On a
machine without GPUs it runs on gloo, which is what the CPU test uses.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.flops import MFU_FORMULA
from benchmarks.multi_gpu_meshes import (
    MESHES,
    SPEED_ROWS,
    default_speed_rows,
    mesh_world,
    one_gpu_row,
    reference,
    row_world,
)
from benchmarks.multi_gpu_worker import worker
from benchmarks.profile_summary import format_summary
from benchmarks.report import fmt, versions, write_json
from benchmarks.shapes import QWEN25_SHAPES

NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Launch the worlds, print the parity and speed tables and return (and write) them."""
    args = _parser().parse_args(argv)
    if args.meshes is None:
        args.meshes = [m for m in MESHES if mesh_world(m) == args.nproc]
    if args.speed is None:
        args.speed = default_speed_rows(args.nproc)
    if args.worker:
        worker(args)
        return {}
    result: dict[str, Any] = {
        "versions": versions(),
        "mfu_formula": MFU_FORMULA,
        "args": vars(args),
    }
    with tempfile.TemporaryDirectory() as tmp:
        if args.meshes:
            # The reference's process runs beside the meshes' world: parity is not timed, and
            # the two worlds' models are small.
            references = sorted({reference(m) for m in args.meshes})
            ref, got = _run_together(
                [
                    (1, args, ["--parity", *references], Path(tmp, "ref.json"), None),
                    (args.nproc, args, ["--parity", *args.meshes], Path(tmp, "mesh.json"), None),
                ]
            )
            result["parity"] = _parity_table(args.meshes, ref, got, args.loss_rtol)
        if args.speed:
            # One world per row: a row run after another in the same processes measured up to
            # 28% slower (the earlier row's communicators and cached blocks stay behind). The
            # one-GPU rows of a wave run at once, each alone on its own GPU.
            rows: dict[str, Any] = {}
            _speed_header()
            for wave in speed_waves(args.speed, _gpu_count()):
                gpus = [str(i) if len(wave) > 1 else None for i in range(len(wave))]
                jobs = [
                    (row_world(r), args, ["--rows", r], Path(tmp, f"speed{len(rows) + i}.json"), g)
                    for i, (r, g) in enumerate(zip(wave, gpus, strict=True))
                ]
                for row, gpu, got in zip(wave, gpus, _run_together(jobs), strict=True):
                    rows[row] = got.get(
                        row, got.get("_world", {"status": "error", "error": "not run"})
                    )
                    rows[row]["cuda_visible_devices"] = gpu
                    _speed_line(row, rows[row], rows)
            result["speed"] = rows
    write_json(result, args.json)
    return result


# --- the driver --------------------------------------------------------------------------------


def speed_waves(rows: list[str], gpus: int) -> list[list[str]]:
    """`rows` in the order they run: the one-process rows first, up to `gpus` of them at once
    (each on its own GPU; one at a time without GPUs, where they would share the cores), then
    each row of several processes alone (it takes every GPU)."""
    single = [r for r in rows if row_world(r) == 1]
    lanes = max(gpus, 1)
    waves = [single[i : i + lanes] for i in range(0, len(single), lanes)]
    return waves + [[r] for r in rows if row_world(r) > 1]


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


Job = tuple[int, argparse.Namespace, list[str], Path, str | None]


def _run_together(jobs: list[Job]) -> list[dict[str, Any]]:
    """Run a ``torchrun`` world of this module's worker per job ``(processes, args, what, out,
    CUDA_VISIBLE_DEVICES or None)``, all at once; each world's rank 0 writes its `out`."""
    sys.stdout.flush()  # the tables printed so far come before the workers' output
    started = [(_start(*job), job[3]) for job in jobs]
    results = []
    for proc, out in started:
        code = proc.wait()
        if not out.exists():
            results.append({"_world": {"status": "error", "error": f"torchrun exited {code}"}})
        else:
            results.append(json.loads(out.read_text()))
    return results


def _start(
    nproc: int, args: argparse.Namespace, what: list[str], out: Path, gpus: str | None
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "benchmarks.multi_gpu",
        "--worker",
        "--out",
        str(out),
        *_shared_flags(args),
        *what,
    ]
    env = {**os.environ, **NO_MULTICAST, "PYTHONPATH": _pythonpath()}
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    return subprocess.Popen(cmd, env=env)


def _shared_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--steps", str(args.steps), "--shape", args.shape, "--seq", str(args.seq)]
    flags += ["--micro-batch", str(args.micro_batch), "--timed", str(args.timed)]
    flags += ["--trace", args.trace] if args.trace else []
    flags += ["--host-ops", str(args.host_ops)] if args.host_ops else []
    return flags + (["--tiny"] if args.tiny else [])


def _pythonpath() -> str:
    root = str(Path(__file__).resolve().parent.parent)
    return os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)


def _parity_table(
    meshes: list[str], ref: dict[str, Any], got: dict[str, Any], rtol: float
) -> dict[str, Any]:
    print(
        f"\nparity: bf16, {len(next(iter(ref.values()), {}).get('losses', []))} steps, "
        f"pass when every step's |loss - ref| / ref <= {rtol:g}"
    )
    print(
        f"{'mesh':<16} {'ref loss (first, last)':>24} {'max rel diff':>13} {'max abs diff':>13}  ok"
    )
    table = {}
    for name in meshes:
        mine, base = got.get(name, got.get("_world", {})), ref.get(reference(name), {})
        if mine.get("status") != "ok" or base.get("status") != "ok":
            why = mine.get("error") or base.get("error") or "not run"
            table[name] = {"status": "error", "error": why}
            print(f"{name:<16} error: {why[:200]}")
            continue
        a, b = torch.tensor(mine["losses"]), torch.tensor(base["losses"])
        abs_diff = (a - b).abs()
        rel = float((abs_diff / b.abs()).max())
        ok = rel <= rtol
        table[name] = {
            "status": "ok",
            "losses": mine["losses"],
            "ref": base["losses"],
            "max_rel": rel,
            "max_abs": float(abs_diff.max()),
            "pass": ok,
        }
        print(
            f"{name:<16} {b[0]:>11.5f}, {b[-1]:>10.5f} {rel:>13.2e} {float(abs_diff.max()):>13.2e}  "
            f"{'yes' if ok else 'NO'}"
        )
    return table


def _speed_header() -> None:
    print(f"\nspeed ({MFU_FORMULA}, peak per GPU x GPUs)")
    print(
        f"{'row':<15} {'gpus':>4} {'tokens/s':>10} {'step ms':>8} {'host ms':>8} {'MFU':>6} "
        f"{'peak GiB':>9} {'x 1gpu':>7} "
        f"{'comm ms':>8} {'overlapped':>10} {'exposed ms':>10} {'busy':>6}",
        flush=True,
    )


def _speed_line(name: str, row: dict[str, Any], done: dict[str, Any]) -> None:
    """Print speed row `name` (adding its ``scaling`` against its backend's one-GPU row among
    the rows `done`), as soon as its world has finished: a run cut short keeps what it printed."""
    if row.get("status") != "ok":
        print(f"{name:<15} error: {row.get('error', '')[:200]}", flush=True)
        return
    base = done.get(one_gpu_row(name), {})
    scale = row["tokens_per_s"] / base["tokens_per_s"] if base.get("status") == "ok" else None
    row["scaling"] = scale
    overlap = row.get("overlap") or {}
    print(
        f"{name:<15} {row['gpus']:>4} {row['tokens_per_s']:>10,.0f} {row['step_ms']:>8.1f} "
        f"{_num(row.get('host_ms'), '.1f'):>8} {_pct(row.get('mfu')):>6} "
        f"{_num(row.get('peak_mem_gib'), '.1f'):>9} "
        f"{_num(scale, '.2f'):>7} {_num(overlap.get('comm_ms'), '.1f'):>8} "
        f"{_pct(overlap.get('overlapped')):>10} {_num(overlap.get('exposed_comm_ms'), '.1f'):>10} "
        f"{_pct(overlap.get('busy')):>6}"
    )
    if overlap:
        print(f"  {format_summary(overlap)}")
    for op in row.get("host_ops", []):
        print(f"  host {op['self_ms']:7.2f} ms {op['calls']:6.0f} calls  {op['name'][:70]}")
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in row.get("phases_s", {}).items())
    gpu = row.get("cuda_visible_devices")
    print(f"  phases: {phases}" + ("" if gpu is None else f"; alone on GPU {gpu}"))
    sys.stdout.flush()


def _pct(x: float | None) -> str:
    return fmt(x, ".1f", 100.0, "%", none="-")


def _num(x: float | None, spec: str) -> str:
    return fmt(x, spec, none="-")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="processes (GPUs) of the parallel runs")
    p.add_argument(
        "--meshes", nargs="*", choices=list(MESHES), help="default: the meshes of --nproc ranks"
    )
    p.add_argument(
        "--speed",
        nargs="*",
        choices=list(SPEED_ROWS),
        help="default: the rows of one and of --nproc ranks",
    )
    p.add_argument("--steps", type=int, default=5, help="parity steps per mesh")
    p.add_argument("--loss-rtol", type=float, default=2e-2)
    p.add_argument("--shape", default="qwen2.5-1.5b", choices=list(QWEN25_SHAPES))
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4, help="rows per data rank per step")
    p.add_argument("--timed", type=int, default=8, help="timed steps per speed row (median)")
    p.add_argument("--tiny", action="store_true", help="parity on the tests' 2-layer models")
    p.add_argument("--trace", help="keep each speed row's profiler trace (per rank) in this folder")
    p.add_argument(
        "--host-ops", type=int, default=0, help="list each row's N costliest host operators"
    )
    p.add_argument("--json", help="write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--parity", nargs="*", help=argparse.SUPPRESS)
    p.add_argument("--rows", nargs="*", help=argparse.SUPPRESS)
    return p


if __name__ == "__main__":
    main()
