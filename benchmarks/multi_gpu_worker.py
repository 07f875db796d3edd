"""The processes of `benchmarks.multi_gpu`'s ``torchrun`` worlds (``--worker``): each trains
the parity meshes or the speed rows it is given and its rank 0 writes their results to
``--out``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoConfig

import twinkle_fn as tf
from benchmarks.flops import default_peak, flops_per_token, mfu
from benchmarks.multi_gpu_meshes import MESHES, PARITY_MODELS, SPEED_ROWS
from benchmarks.profile_summary import host_ops, profile_steps
from benchmarks.shapes import qwen25_config
from benchmarks.timing import error_row, peak_gib, time_steps
from benchmarks.training import host_batch, padded_batch, train_step, twinkle_optimizer
from twinkle_fn.data import pad_collate
from twinkle_fn.distributed import init_distributed, rank
from twinkle_fn.testing import random_features, tiny_config

_PARITY_LR = 1e-3
_GLOBAL_BATCH, _MIN_LEN, _MAX_LEN = 16, 64, 512


def worker(args: argparse.Namespace) -> None:
    """Run this rank's share of ``args.parity`` meshes and ``args.rows`` speed rows; rank 0
    writes them to ``args.out``."""
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
        return error_row(e, limit=800)
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
    state = tf.init(model, twinkle_optimizer(backend, _PARITY_LR), mesh)
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
    global_batch = args.micro_batch * mesh.data_world_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (global_batch, args.seq), generator=gen)
    batch = host_batch(padded_batch(ids[mesh.get_slice(global_batch, rank())]), device)
    step = train_step(tf.init(model, twinkle_optimizer(backend), mesh), [batch])
    built = time.perf_counter()
    timing = time_steps(step, 3, args.timed, device)
    timed = time.perf_counter()
    tokens_per_s = global_batch * args.seq / timing.seconds
    peak, peak_mem = default_peak(device), peak_gib(device)
    row = {
        "gpus": mesh.world_size,
        "global_batch": global_batch,
        "step_ms": 1e3 * timing.seconds,
        "host_ms": _max_over_ranks(1e3 * timing.host_seconds),
        "tokens_per_s": tokens_per_s,
        "mfu": mfu(
            tokens_per_s,
            flops_per_token(config, args.seq),
            None if peak is None else peak * mesh.world_size,
        ),
        "peak_mem_gib": None if peak_mem is None else _max_over_ranks(peak_mem),
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
