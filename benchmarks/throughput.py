"""Training throughput on one device: issue 6's baselines beside twinkle_fn's functional API.

Every row trains the same randomly initialised Qwen2.5-shaped model (configs built by hand, no
download) on the same ``[batch, seq]`` random tokens, with bf16 compute over fp32 master weights,
AdamW (lr 1e-5, weight decay 0.01) and global-norm clipping at 1.0:

- ``hf_loop``: a plain transformers loop: SDPA attention, bf16 autocast over fp32 parameters,
  ``model(labels=...).loss``, ``clip_grad_norm_`` and fused AdamW;
- ``hf_compiled``: the same with ``torch.compile`` of the whole model (``--compile layer``: of
  each decoder layer instead); GPU only, since compiling on a CPU takes minutes;
- ``mcore_local``: raw megatron-core ``GPTModel`` with its local layer spec, bf16 parameters
  with the distributed optimizer's fp32 master copies, DDP, ``get_forward_backward_func``;
- ``mcore_sdpa``: the same with twinkle's SDPA layer spec (`twinkle_fn.backends.megatron.model`);
- ``twinkle_fsdp``: ``tf.fwd_bwd`` + ``tf.step`` on the transformers backend, padded batch
  handed over on the host (pinned), as a data loader would;
- ``twinkle_fsdp_compiled``: the same with each decoder layer compiled (option
  ``compile_layers``; GPU only, like ``hf_compiled``);
- ``twinkle_fsdp_compiled_ckpt``: the same with activation checkpointing of every decoder
  layer (recomputed in backward: the MFU formula does not count the recompute), the memory
  end of the trade-off;
- ``twinkle_fsdp_compiled_budget``: ``twinkle_fsdp_compiled`` with a memory budget of 0.6
  for each compiled layer (``compile_layers={"memory_budget": 0.6}``): the partitioner
  recomputes the cheapest activations per byte instead of whole layers;
- ``twinkle_megatron``: the same on the megatron backend with its `megatron_optimizer`
  (megatron-core's distributed optimizer), when `twinkle_fn.backends` has that backend;
- ``twinkle_megatron_compiled``: the same with each decoder layer compiled (GPU only).

Each row warms up, then takes the median of timed steps (the device synchronised around each).
It reports tokens/s (``batch * seq`` tokens per step), MFU, CUDA peak allocated memory, step
time and ratios to the baselines. A row that fails (out of memory, megatron-core missing) is
reported as an error and the run goes on; the JSON is rewritten after every row, so a run cut
short keeps what it measured.

    python -m benchmarks.throughput --shape qwen2.5-0.5b --seq 2048 --batch 8 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
from collections.abc import Callable, Iterator
from types import MappingProxyType
from typing import Any

import torch
from transformers import PretrainedConfig

from benchmarks.cli import device_of, positive_int
from benchmarks.flops import MFU_FORMULA, default_peak, flops_per_token, matmul_params, mfu
from benchmarks.mcore_baseline import mcore_step
from benchmarks.profile_summary import format_summary, profile_steps
from benchmarks.report import (
    add_ratios,
    device_name,
    fmt,
    not_ok,
    print_table,
    versions,
    write_json,
)
from benchmarks.shapes import QWEN25_SHAPES, qwen25_config
from benchmarks.timing import (
    Step,
    allocated_gib,
    peak_gib,
    run_isolated,
    skipped_row,
    time_steps,
)
from benchmarks.training import Setup, hf_step, megatron_world, twinkle_step

ROWS = (
    "hf_loop",
    "hf_compiled",
    "mcore_local",
    "mcore_sdpa",
    "twinkle_fsdp",
    "twinkle_fsdp_compiled",
    "twinkle_fsdp_compiled_ckpt",
    "twinkle_fsdp_compiled_budget",
    "twinkle_megatron",
    "twinkle_megatron_compiled",
)
BASELINES = ("hf_loop", "hf_compiled", "mcore_local")
RowBuilder = Callable[[Setup], contextlib.AbstractContextManager[Step]]


def main(argv: list[str] | None = None) -> dict:
    """Run the selected rows and return (and print, and write) the results."""
    args = _parser().parse_args(argv)
    device = device_of(args.device)
    config = qwen25_config(args.shape)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=gen)
    setup = Setup(config, ids.to(device), device, args.compile, args.profile)
    result = _header(args, config, device)
    _print_header(result)
    for name in args.rows:
        row = _run_row(name, setup, args.warmup, args.steps)
        if row["status"] == "ok":
            row["mfu"] = mfu(row["tokens_per_s"], result["flops_per_token"], result["peak_flops"])
        result["rows"][name] = row
        _print_row(name, row)
        add_ratios(result["rows"], BASELINES)
        write_json(result, args.json)
    _print_table(result)
    return result


def _header(args: argparse.Namespace, config: PretrainedConfig, device: torch.device) -> dict:
    fpt = flops_per_token(config, args.seq)
    peak = args.peak_flops if args.peak_flops is not None else default_peak(device)
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": str(device),
        "device_name": device_name(device),
        "versions": versions(),
        "shape": args.shape,
        "seq": args.seq,
        "batch": args.batch,
        "tokens_per_step": args.batch * args.seq,
        "matmul_params": matmul_params(config),
        "flops_per_token": fpt,
        "peak_flops": peak,
        "mfu_formula": MFU_FORMULA,
        "compile_scope": args.compile,
        "args": vars(args),
        "rows": {},
    }


def _run_row(name: str, setup: Setup, warmup: int, steps: int) -> dict[str, Any]:
    """One row's measurement, or why it was skipped or failed; its memory is released after."""
    skipped = skipped_row(name, setup.device, "twinkle_fn.backends has no 'megatron' backend yet")
    return skipped or run_isolated(setup.device, lambda: _measure(name, setup, warmup, steps))


def _measure(name: str, setup: Setup, warmup: int, steps: int) -> dict[str, Any]:
    """Build the row, time it; everything it built is unreachable once this returns."""
    leftover_gib = allocated_gib(setup.device)  # not 0: an earlier row leaked memory
    with _ROW_BUILDERS[name](setup) as step:
        timing = time_steps(step, warmup, steps, setup.device)
        peak = peak_gib(setup.device)
        profile = profile_steps(step) if setup.profile and setup.device.type == "cuda" else None
    batch, seq = setup.input_ids.shape
    return {
        "status": "ok",
        "step_ms": 1e3 * timing.seconds,
        "host_ms": 1e3 * timing.host_seconds,
        "tokens_per_s": batch * seq / timing.seconds,
        "peak_mem_gib": peak,
        "first_loss": timing.first_loss,
        "last_loss": timing.last_loss,
        "leftover_gib": leftover_gib,
        "profile": profile,
    }


# --- rows ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _hf_loop(setup: Setup) -> Iterator[Step]:
    yield hf_step(setup, compile_scope=None)


@contextlib.contextmanager
def _hf_compiled(setup: Setup) -> Iterator[Step]:
    yield hf_step(setup, compile_scope=setup.compile_scope)


@contextlib.contextmanager
def _mcore_local(setup: Setup) -> Iterator[Step]:
    with megatron_world(setup.device):
        yield mcore_step(setup, our_spec=False)


@contextlib.contextmanager
def _mcore_sdpa(setup: Setup) -> Iterator[Step]:
    with megatron_world(setup.device):
        yield mcore_step(setup, our_spec=True)


@contextlib.contextmanager
def _twinkle_fsdp(setup: Setup) -> Iterator[Step]:
    yield twinkle_step(setup, backend="transformers")


@contextlib.contextmanager
def _twinkle_fsdp_compiled(setup: Setup) -> Iterator[Step]:
    yield twinkle_step(setup, backend="transformers", options={"compile_layers": True})


@contextlib.contextmanager
def _twinkle_fsdp_compiled_ckpt(setup: Setup) -> Iterator[Step]:
    yield twinkle_step(
        setup,
        backend="transformers",
        options={"compile_layers": True},
        activation_checkpointing=True,
    )


@contextlib.contextmanager
def _twinkle_fsdp_compiled_budget(setup: Setup) -> Iterator[Step]:
    options = {"compile_layers": {"memory_budget": 0.6}}
    yield twinkle_step(setup, backend="transformers", options=options)


@contextlib.contextmanager
def _twinkle_megatron(setup: Setup) -> Iterator[Step]:
    with megatron_world(setup.device):
        yield twinkle_step(setup, backend="megatron")


@contextlib.contextmanager
def _twinkle_megatron_compiled(setup: Setup) -> Iterator[Step]:
    with megatron_world(setup.device):
        yield twinkle_step(setup, backend="megatron", options={"compile_layers": True})


_ROW_BUILDERS: MappingProxyType[str, RowBuilder] = MappingProxyType(
    {
        "hf_loop": _hf_loop,
        "hf_compiled": _hf_compiled,
        "mcore_local": _mcore_local,
        "mcore_sdpa": _mcore_sdpa,
        "twinkle_fsdp": _twinkle_fsdp,
        "twinkle_fsdp_compiled": _twinkle_fsdp_compiled,
        "twinkle_fsdp_compiled_ckpt": _twinkle_fsdp_compiled_ckpt,
        "twinkle_fsdp_compiled_budget": _twinkle_fsdp_compiled_budget,
        "twinkle_megatron": _twinkle_megatron,
        "twinkle_megatron_compiled": _twinkle_megatron_compiled,
    }
)


# --- output -------------------------------------------------------------------------------


def _print_header(result: dict) -> None:
    peak = result["peak_flops"]
    print(
        f"{result['shape']}, seq {result['seq']}, batch {result['batch']} "
        f"({result['tokens_per_step']} tokens/step) on {result['device_name']}; "
        f"versions {json.dumps(result['versions'])}"
    )
    print(
        f"{result['mfu_formula']}; matmul params {result['matmul_params']:,}, "
        f"{result['flops_per_token'] / 1e9:.3f} GFLOP/token, peak "
        f"{'n/a' if peak is None else f'{peak:.4g} FLOP/s'}; hf_compiled compiles the "
        f"{'whole model' if result['compile_scope'] == 'model' else 'decoder layers'}"
    )


def _print_row(name: str, row: dict[str, Any]) -> None:
    if row["status"] != "ok":
        print(f"{name}: {not_ok(row)}", flush=True)
        return
    print(
        f"{name}: {row['tokens_per_s']:.0f} tokens/s, {row['step_ms']:.1f} ms/step, "
        f"loss {row['first_loss']:.3f} -> {row['last_loss']:.3f}",
        flush=True,
    )
    if row.get("profile"):
        print(f"  {format_summary(row['profile'])}", flush=True)


def _print_table(result: dict) -> None:
    head = ("row", "tokens/s", "MFU", "peak GiB", "step ms", "x hf_loop", "x compiled", "x mcore")
    rows = result["rows"]
    print_table(
        (*head, "mem/compiled"),
        ((name, rows[name]) for name in sorted(rows, key=ROWS.index)),
        lambda name, row: (
            name,
            fmt(row["tokens_per_s"], ".0f"),
            fmt(row["mfu"], ".1f", 100.0, "%"),
            fmt(row["peak_mem_gib"], ".1f"),
            fmt(row["step_ms"], ".1f"),
            *(fmt(row[f"x_{base}"], ".2f") for base in BASELINES),
            fmt(row["mem_vs_hf_compiled"], ".2f"),
        ),
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=tuple(QWEN25_SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--seq", type=positive_int, default=2048)
    p.add_argument("--batch", type=positive_int, default=8)
    p.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    p.add_argument("--steps", type=positive_int, default=10)
    p.add_argument("--warmup", type=positive_int, default=3)
    p.add_argument("--compile", choices=("model", "layer"), default="model")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--peak-flops", type=float, default=None, help="default: 989e12 on H100/H200")
    p.add_argument("--json", default="throughput.json")
    p.add_argument("--profile", action="store_true", help="profile two steps per row (GPU)")
    return p


if __name__ == "__main__":
    main()
