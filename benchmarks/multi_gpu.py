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
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoConfig

import twinkle_fn as tf
from benchmarks.profile_summary import format_summary, host_ops, profile_steps
from benchmarks.throughput import (
    MFU_FORMULA,
    SHAPES,
    default_peak,
    flops_per_token,
    host_batch,
    padded_batch,
    qwen25_config,
    time_steps,
    twinkle_optimizer,
    versions,
)
from twinkle_fn.data import pad_collate
from twinkle_fn.distributed import init_distributed, rank
from twinkle_fn.testing import random_features, tiny_config

NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# The parity models: small enough for seconds per mesh, wide enough for tp2 / cp2 / ep2 splits.
PARITY_MODELS = {
    "dense": dict(
        model_type="qwen2",
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    ),
    "moe": dict(
        model_type="qwen3_moe",
        vocab_size=1024,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        decoder_sparse_step=1,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    ),
}
# mesh name -> (backend, model, mesh sizes, backend options)
MESHES: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    "fsdp/dp2": ("fsdp", "dense", {"dp": 2}, {}),
    "fsdp/fsdp2": ("fsdp", "dense", {"fsdp": 2}, {}),
    "fsdp/tp2": ("fsdp", "dense", {"tp": 2}, {}),
    "megatron/tp2": ("megatron", "dense", {"tp": 2}, {}),
    "megatron/pp2": ("megatron", "dense", {"pp": 2}, {"num_micro_batches": 2}),
    "megatron/cp2": ("megatron", "dense", {"cp": 2}, {}),
    "megatron/dp2": ("megatron", "dense", {"dp": 2}, {"overlap_param_gather": True}),
    "megatron/ep2": ("megatron", "moe", {"dp": 2, "ep": 2}, {"overlap_param_gather": True}),
    # four ranks (issue 8)
    "fsdp/fsdp4": ("fsdp", "dense", {"fsdp": 4}, {}),
    "fsdp/dp2xfsdp2": ("fsdp", "dense", {"dp": 2, "fsdp": 2}, {}),
    "megatron/tp2xpp2": ("megatron", "dense", {"tp": 2, "pp": 2}, {"num_micro_batches": 2}),
    "megatron/dp2xtp2": ("megatron", "dense", {"dp": 2, "tp": 2}, {}),
    "megatron/ep4": ("megatron", "moe", {"dp": 4, "ep": 4}, {}),
    "megatron/ep2xtp2": (
        "megatron",
        "moe",
        {"dp": 2, "tp": 2, "ep": 2, "sequence_parallel": True},
        {},
    ),
}
# speed row -> (backend, mesh sizes, backend options); a row's process count is its mesh's size.
# The megatron rows reduce gradients bucket by bucket during backward (issue 7's overlap).
# "megatron/dp2-gather" also gathers the distributed optimizer's parameters during the next
# forward; it is not a default row: at 1.5B on two H200s it ran 19% slower than megatron/dp2
# (62.1k against 76.2k tok/s, benchmarks/RESULTS.md), so it is there to be profiled on demand.
_OVERLAP = {"overlap_grad_reduce": True}
_OVERLAP_GATHER = {**_OVERLAP, "overlap_param_gather": True}
SPEED_ROWS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "fsdp/1gpu": ("fsdp", {}, {}),
    "fsdp/dp2": ("fsdp", {"dp": 2}, {}),
    "fsdp/fsdp2": ("fsdp", {"fsdp": 2}, {}),
    "fsdp/tp2": ("fsdp", {"tp": 2}, {}),
    "megatron/1gpu": ("megatron", {}, _OVERLAP),
    "megatron/dp2": ("megatron", {"dp": 2}, _OVERLAP),
    "megatron/dp2-gather": ("megatron", {"dp": 2}, _OVERLAP_GATHER),
    "megatron/tp2": ("megatron", {"tp": 2}, _OVERLAP),
    "fsdp/fsdp4": ("fsdp", {"fsdp": 4}, {}),
    "fsdp/dp2xfsdp2": ("fsdp", {"dp": 2, "fsdp": 2}, {}),
    "megatron/tp2xpp2": ("megatron", {"tp": 2, "pp": 2}, _OVERLAP),
    "megatron/dp2xtp2": ("megatron", {"dp": 2, "tp": 2}, _OVERLAP),
}
# The "-compiled" rows compile each decoder layer (``compile_layers``): fewer kernel launches,
# for steps the host bounds in eager mode (benchmarks/NOTES.md, session 6). Each scales against
# its backend's compiled one-GPU row, and they are opt-in until measured on two GPUs.
_COMPILED = {"compile_layers": True}
SPEED_ROWS.update(
    {
        "fsdp/1gpu-compiled": ("fsdp", {}, _COMPILED),
        "fsdp/dp2-compiled": ("fsdp", {"dp": 2}, _COMPILED),
        "fsdp/fsdp2-compiled": ("fsdp", {"fsdp": 2}, _COMPILED),
        "megatron/1gpu-compiled": ("megatron", {}, {**_OVERLAP, **_COMPILED}),
        "megatron/dp2-compiled": ("megatron", {"dp": 2}, {**_OVERLAP, **_COMPILED}),
    }
)
_OPT_IN = (  # rows run only when --speed names them
    "megatron/dp2-gather",
    "fsdp/1gpu-compiled",
    "fsdp/dp2-compiled",
    "fsdp/fsdp2-compiled",
    "megatron/1gpu-compiled",
    "megatron/dp2-compiled",
)
_PARITY_LR = 1e-3
_GLOBAL_BATCH, _MIN_LEN, _MAX_LEN = 16, 64, 512


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Launch the worlds, print the parity and speed tables and return (and write) them."""
    args = _parser().parse_args(argv)
    if args.meshes is None:
        args.meshes = [m for m in MESHES if _mesh_world(m) == args.nproc]
    if args.speed is None:
        args.speed = default_speed_rows(args.nproc)
    if args.worker:
        _worker(args)
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
            references = sorted({_reference(m) for m in args.meshes})
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
                    (_row_world(r), args, ["--rows", r], Path(tmp, f"speed{len(rows) + i}.json"), g)
                    for i, (r, g) in enumerate(zip(wave, gpus, strict=True))
                ]
                for row, gpu, got in zip(wave, gpus, _run_together(jobs), strict=True):
                    rows[row] = got.get(
                        row, got.get("_world", {"status": "error", "error": "not run"})
                    )
                    rows[row]["cuda_visible_devices"] = gpu
                    _speed_line(row, rows[row], rows)
            result["speed"] = rows
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


# --- the driver --------------------------------------------------------------------------------


def default_speed_rows(nproc: int) -> list[str]:
    """The speed rows of one and of `nproc` processes, without the opt-in ones."""
    return [r for r in SPEED_ROWS if _row_world(r) in (1, nproc) and r not in _OPT_IN]


def one_gpu_row(row: str) -> str:
    """The one-GPU row `row` scales against: its backend's, with the same variant suffix
    (``fsdp/dp2-compiled`` -> ``fsdp/1gpu-compiled``) where there is one."""
    backend, mesh = row.split("/")
    variant = f"{backend}/1gpu-{mesh.partition('-')[2]}"
    return variant if variant in SPEED_ROWS else f"{backend}/1gpu"


def _reference(mesh_name: str) -> str:
    backend, model, _, _ = MESHES[mesh_name]
    return f"ref/{backend}/{model}"


def _mesh_world(mesh_name: str) -> int:
    return tf.Mesh(**MESHES[mesh_name][2]).world_size


def _row_world(row: str) -> int:
    return tf.Mesh(**SPEED_ROWS[row][1]).world_size


def speed_waves(rows: list[str], gpus: int) -> list[list[str]]:
    """`rows` in the order they run: the one-process rows first, up to `gpus` of them at once
    (each on its own GPU; one at a time without GPUs, where they would share the cores), then
    each row of several processes alone (it takes every GPU)."""
    single = [r for r in rows if _row_world(r) == 1]
    lanes = max(gpus, 1)
    waves = [single[i : i + lanes] for i in range(0, len(single), lanes)]
    return waves + [[r] for r in rows if _row_world(r) > 1]


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
        mine, base = got.get(name, got.get("_world", {})), ref.get(_reference(name), {})
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
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


# --- the workers -------------------------------------------------------------------------------


def _worker(args: argparse.Namespace) -> None:
    init_distributed()
    device = _device()
    out: dict[str, Any] = {}
    for name in args.parity or []:
        out[name] = _guarded(_parity_run, name, args, device)
    for name in args.rows or []:
        out[name] = _guarded(_speed_run, name, args, device)
    if rank() == 0:
        Path(args.out).write_text(json.dumps(out, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _guarded(fn: Any, name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """`fn`'s row, or the error it raised (an OOM or a refused mesh is a result, not a crash)."""
    try:
        return {"status": "ok", **fn(name, args, device)}
    except Exception as e:
        return {"status": "error", "error": f"{type(e).__name__}: {e}"[:800]}
    finally:
        _leave_megatron()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)


def _leave_megatron() -> None:
    if "megatron.core" not in sys.modules:  # a world of transformers rows never imports it
        return
    from megatron.core import parallel_state

    from twinkle_fn.backends.megatron import parallel

    if parallel_state.model_parallel_is_initialized():
        parallel.destroy()


def _parity_config(model: str, tiny: bool) -> Any:
    cfg = PARITY_MODELS[model]
    if tiny:  # CPU runs: the test suite's 2-layer model of the same family, 8 experts for MoE
        extra = {"num_experts": 8} if model == "moe" else {}
        return tiny_config(cfg["model_type"], vocab_size=256, **extra)
    return AutoConfig.for_model(**cfg)


def _parity_run(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """`args.steps` AdamW steps of mesh `name` (or of a ``ref/...`` one-process reference)."""
    if name.startswith("ref/"):
        _, backend, model_name = name.split("/")
        sizes, options = {}, {}
    else:
        backend, model_name, sizes, options = MESHES[name]
    config = _parity_config(model_name, args.tiny)
    mesh = tf.Mesh(**sizes)
    model = tf.models.from_hf_config(
        config, backend=backend, precision="bf16", device=device, seed=0, options=options
    )
    tx = _parity_optimizer(backend)
    state = tf.init(model, tx, mesh)
    losses = []
    lens = (8, 48) if args.tiny else (_MIN_LEN, _MAX_LEN)
    for i in range(args.steps):
        feats = random_features(
            _GLOBAL_BATCH,
            vocab_size=config.vocab_size,
            min_len=lens[0],
            max_len=lens[1],
            seed=100 + i,
        )
        mine = feats[mesh.get_slice(len(feats), rank())]
        batch = {k: v.to(device) for k, v in pad_collate(mine, pad_token_id=0).items()}
        grads, _ = tf.fwd_bwd(state, batch)
        state, info = tf.step(state, grads)
        losses.append(float(info["loss"]))
    return {"losses": losses}


def _parity_optimizer(backend: str) -> tf.optim.GradientTransformation:
    if backend == "megatron":
        from twinkle_fn.optim import megatron_optimizer

        return megatron_optimizer(_PARITY_LR, clip_grad=1.0, weight_decay=0.01)
    return tf.optim.chain(
        tf.optim.clip_by_global_norm(1.0), tf.optim.adamw(_PARITY_LR, weight_decay=0.01)
    )


def _speed_run(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Tokens/s, MFU and peak memory of speed row `name`; a profile of the overlap when dp > 1.

    ``phases_s``: seconds spent building the model and state, in the warm-up and timed steps, and
    profiling (where a world's time goes against the device's per-call limit).
    """
    started = time.perf_counter()
    backend, sizes, options = SPEED_ROWS[name]
    mesh = tf.Mesh(**sizes)
    config = qwen25_config(args.shape)
    model = tf.models.from_hf_config(
        config, backend=backend, precision="bf16", device=device, seed=0, options=options
    )
    holder = [tf.init(model, twinkle_optimizer(backend), mesh)]
    global_batch = args.micro_batch * mesh.data_world_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (global_batch, args.seq), generator=gen)
    batch = host_batch(padded_batch(ids[mesh.get_slice(global_batch, rank())]), device)

    def step() -> torch.Tensor:
        grads, _ = tf.fwd_bwd(holder[0], batch)
        holder[0], info = tf.step(holder[0], grads)
        return info["loss"]

    built = time.perf_counter()
    timing = time_steps(step, 3, args.timed, device)
    timed = time.perf_counter()
    tokens_per_s = global_batch * args.seq / timing.seconds
    peak = default_peak(device)
    row = {
        "gpus": mesh.world_size,
        "global_batch": global_batch,
        "step_ms": 1e3 * timing.seconds,
        "host_ms": _max_over_ranks(1e3 * timing.host_seconds),
        "tokens_per_s": tokens_per_s,
        "mfu": None
        if peak is None
        else tokens_per_s * flops_per_token(config, args.seq) / (peak * mesh.world_size),
        "peak_mem_gib": _max_over_ranks(torch.cuda.max_memory_allocated(device) / 2**30)
        if device.type == "cuda"
        else None,
        "first_loss": timing.first_loss,
        "last_loss": timing.last_loss,
    }
    if device.type == "cuda":
        trace = (
            None
            if args.trace is None
            else Path(args.trace, f"{name.replace('/', '_')}.{rank()}.json.gz")
        )
        row["overlap"] = profile_steps(step, trace=trace)
    if args.host_ops:
        row["host_ops"] = host_ops(step, top=args.host_ops)
    row["phases_s"] = {
        "build": built - started,
        "steps": timed - built,
        "profile": time.perf_counter() - timed,
    }
    return row


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


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
    p.add_argument("--shape", default="qwen2.5-1.5b", choices=list(SHAPES))
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
