"""Speed and memory of issue 25's one-GPU workloads, every baseline in the same run.

Each row trains a randomly initialised model of ``--shape`` (configs built by hand, no download)
on the same ``[batch, seq]`` random tokens (labels: the next token), bf16 compute, AdamW (lr
1e-5, weight decay 0.01). ``--workload lora`` (LoRA r=16, alpha 32, every decoder linear, the
lm_head left out):

- ``peft_eager``: the peft loop users write: the HF model loaded in bf16
  (``dtype=torch.bfloat16``), ``peft.get_peft_model`` (adapters upcast to float32, peft's
  default), bf16 autocast, ``model(labels=...).loss``, fused AdamW over the adapters;
- ``peft_compiled``: the same with ``torch.compile`` of the whole model (GPU only);
- ``twinkle_transformers``: ``tf.lora.add_lora`` + ``tf.init`` + ``tf.fwd_bwd`` / ``tf.step``
  on the transformers backend (frozen base in bf16, float32 adapters), clipping at 1.0;
- ``twinkle_transformers_compiled``: the same with ``compile_layers`` (GPU only);
- ``twinkle_megatron`` / ``twinkle_megatron_compiled``: the same on the megatron backend with
  its ``megatron_optimizer``;
- ``twinkle_transformers_compiled_fp8`` / ``twinkle_megatron_compiled_fp8``: the compiled rows
  with ``fp8="tensorwise"``: the frozen base linears' forward and input-gradient GEMMs in
  float8 (GPU only);
- ``twinkle_transformers_compiled_fp8_stored`` / ``twinkle_megatron_compiled_fp8_stored``: the
  fp8 rows with ``fp8_store_frozen=True``: the frozen bases stored in float8 (one byte an
  element, never quantised again; the same numbers as tensorwise quantising them every step).

``--workload full`` (full fine-tuning, clipping at 1.0):

- ``twinkle_transformers_adamw``: float32 master weights and AdamW moments (16 bytes a
  parameter: the reference that does not fit 80 GB at the 4B shape);
- ``twinkle_transformers_adamw_bf16`` / ``_compiled``: ``options={"master_weights": False}``
  and `twinkle_fn.optim.adamw_bf16` (bf16 parameters, gradients and moments, stochastic
  rounding: 8 bytes a parameter);
- ``twinkle_megatron_adamw_bf16`` / ``_compiled``: `twinkle_fn.optim.adamw_bf16` on the megatron
  backend's bf16 parameters (its float32 grad buffer: 10 bytes a parameter);
- ``twinkle_megatron_distopt``: the distributed optimizer (float32 main parameters and moments: 18 bytes
  a parameter).

``--workload load`` (a bf16 checkpoint of the shape, written once to ``--checkpoint`` when that
directory has none, its files read once before the rows so every row reads from the page
cache): the wall time to load it onto the device, and to ``tf.init`` a LoRA state over it:

- ``hf_from_pretrained``: ``AutoModelForCausalLM.from_pretrained(dir, dtype=torch.bfloat16,
  device_map=<device>)`` (no init);
- ``twinkle_transformers``: ``tf.models.from_pretrained(dir, precision="bf16")``, then
  ``tf.lora.add_lora`` and ``tf.init``;
- ``twinkle_megatron``: the same on the megatron backend (which reads its slices of the files
  in ``tf.init``).

Each row reports seconds (load, init, total), GB/s (checkpoint bytes over the total) and the
peak memory.

``--workload fp8`` (full fine-tuning, AdamW with float32 masters and clipping; the shapes of
`benchmarks.throughput` too: ``--shape qwen2.5-0.5b`` / ``qwen2.5-1.5b``): each backend bf16
against the model option ``fp8`` (`twinkle_fn.backends.fp8`), eager and with
``compile_layers``: ``twinkle_<backend>_bf16[_compiled]``, ``twinkle_<backend>_fp8[_compiled]``
(rowwise) and ``twinkle_<backend>_fp8_tensorwise_compiled``. Each row also reports MFU against
the bf16 peak (`benchmarks.flops.MFU_FORMULA`: the bf16 FLOPs the step does, so an fp8
row's MFU is its speed-up over bf16 in the same units, not a utilisation of the fp8 peak).

``--workload fp8_parity``: the same rows trained ``--parity-steps`` steps (default 200) on the
built-in arithmetic chat data (character tokens, ``--parity-samples`` samples packed into one
row a step, lr 1e-4 after 10 warm-up steps), every row on the same batches. Each row reports its
loss curve and final loss (the mean of the last 10 steps) and each fp8 row the difference from
its backend's bf16 row of the same compilation (``loss_diff_vs_bf16``: final; ``max_loss_diff``:
the largest difference of 10-step means along the curve).

Each training row warms up, then takes the median of timed steps (`benchmarks.timing.time_steps`).
Tokens/s counts ``batch * seq`` tokens a step; peak memory is CUDA's peak allocated bytes over
the steps (what construction left allocated counts; a transient of construction, such as the
transformers backend's float32 module before ``tf.init`` stores a LoRA base in bf16, does not)
in GiB. A failing row (out of memory) is reported
and the run goes on; the JSON is rewritten after every row. ``--profile`` adds a profile of two
more steps per row on a GPU (`benchmarks.profile_summary`: kernel time by kind, idle gaps, top
kernels); ``--trace DIR`` also keeps each row's trace there (``<row>.json.gz``, for Perfetto
or ``python -m benchmarks.profile_summary DIR/<row>.json.gz``).

    python -m benchmarks.one_gpu --workload lora --shape qwen3-4b --seq 2048 --batch 4 \\
        --json lora.json
    python -m benchmarks.one_gpu --workload full --shape qwen3-4b --seq 2048 --batch 4 \\
        --json full.json
    python -m benchmarks.one_gpu --workload load --shape qwen3-4b --checkpoint /tmp/qwen3-4b \\
        --json load.json
    python -m benchmarks.one_gpu --workload fp8 --shape qwen2.5-1.5b --seq 2048 --batch 8 \\
        --json fp8.json
    python -m benchmarks.one_gpu --workload fp8_parity --shape qwen2.5-0.5b \\
        --rows twinkle_transformers_bf16_compiled twinkle_transformers_fp8_compiled \\
        --json fp8_parity.json
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from benchmarks.checkpoint_loading import run_load
from benchmarks.cli import device_of, positive_int
from benchmarks.flops import default_peak, flops_per_token, mfu
from benchmarks.fp8_parity import add_speedups, run_parity
from benchmarks.one_gpu_rows import FP8_ROWS, ROWS, OneGpuSetup, skipped
from benchmarks.profile_summary import format_summary, profile_steps
from benchmarks.report import (
    device_name,
    fmt,
    print_json_row,
    print_table,
    versions,
    write_json,
)
from benchmarks.shapes import QWEN3_SHAPES, QWEN25_SHAPES, shape_config
from benchmarks.timing import Step, peak_gib, run_isolated, time_steps

WORKLOADS = MappingProxyType(
    {
        "lora": (
            "peft_eager",
            "peft_compiled",
            "twinkle_transformers",
            "twinkle_transformers_compiled",
            "twinkle_megatron",
            "twinkle_megatron_compiled",
            "twinkle_transformers_compiled_fp8",
            "twinkle_megatron_compiled_fp8",
            "twinkle_transformers_compiled_fp8_stored",
            "twinkle_megatron_compiled_fp8_stored",
        ),
        "full": (
            "twinkle_transformers_adamw",
            "twinkle_transformers_adamw_bf16",
            "twinkle_transformers_adamw_bf16_compiled",
            "twinkle_megatron_adamw_bf16",
            "twinkle_megatron_adamw_bf16_compiled",
            "twinkle_megatron_distopt",
        ),
        "load": ("hf_from_pretrained", "twinkle_transformers", "twinkle_megatron"),
        "fp8": FP8_ROWS,
        "fp8_parity": FP8_ROWS,
    }
)
# The row the others are compared with, per workload.
_REFERENCE = MappingProxyType(
    {
        "lora": "peft_compiled",
        "full": "twinkle_transformers_adamw",
        "fp8": "twinkle_transformers_bf16_compiled",
    }
)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the selected rows of one workload and return (and print, and write) the results."""
    args = _parser().parse_args(argv)
    rows = args.rows or list(WORKLOADS[args.workload])
    unknown = [r for r in rows if r not in WORKLOADS[args.workload]]
    if unknown:
        raise SystemExit(
            f"rows {unknown} are not in workload {args.workload!r}: "
            f"{', '.join(WORKLOADS[args.workload])}"
        )
    device = device_of(args.device)
    config = shape_config(args.shape)
    ids = torch.randint(
        0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)
    )
    setup = OneGpuSetup(
        config,
        ids.to(device),
        device,
        "model",
        activation_checkpointing=args.activation_checkpointing,
        profile=args.profile or args.trace is not None,
        memory_budget=args.memory_budget,
        trace=args.trace,
    )
    if args.workload == "load":
        return run_load(args, config, device, rows)
    if args.workload == "fp8_parity":
        return run_parity(args, setup, rows)
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device_name": device_name(device),
        "versions": versions(),
        "workload": args.workload,
        "shape": args.shape,
        "seq": args.seq,
        "batch": args.batch,
        "tokens_per_step": args.batch * args.seq,
        "activation_checkpointing": args.activation_checkpointing,
        "memory_budget": args.memory_budget,
        "rows": {},
    }
    print(
        f"{args.workload} {args.shape} seq {args.seq} batch {args.batch} on {result['device_name']}"
    )
    peak = default_peak(device)
    for name in rows:
        row = run_row(name, setup, args.warmup, args.steps)
        if row["status"] == "ok":  # bf16 FLOPs over the bf16 peak, fp8 rows included
            row["mfu"] = mfu(row["tokens_per_s"], flops_per_token(config, args.seq), peak)
        result["rows"][name] = row
        add_speedups(result["rows"])
        print_json_row(name, row, leave_out="profile")
        if row.get("profile"):
            print(f"  {format_summary(row['profile'])}", flush=True)
        write_json(result, args.json)
    _print_table(result)
    return result


def run_row(name: str, setup: OneGpuSetup, warmup: int, steps: int) -> dict[str, Any]:
    """One row's measurement, or why it was skipped or failed; its memory is released after."""
    return skipped(name, setup.device) or run_isolated(
        setup.device, lambda: _measure(name, setup, warmup, steps)
    )


def _measure(name: str, setup: OneGpuSetup, warmup: int, steps: int) -> dict[str, Any]:
    with ROWS[name](setup) as step:
        if setup.device.type == "cuda":  # the steps' peak: what stays allocated counts
            torch.cuda.reset_peak_memory_stats(setup.device)
        timing = time_steps(step, warmup, steps, setup.device)
        peak = peak_gib(setup.device)
        profile = _profile(name, step, setup)
    batch, seq = setup.input_ids.shape
    row = {
        "status": "ok",
        "step_ms": 1e3 * timing.seconds,
        "host_ms": 1e3 * timing.host_seconds,  # near step_ms: the host bounds the step
        "tokens_per_s": batch * seq / timing.seconds,
        "peak_mem_gib": peak,
        "first_loss": timing.first_loss,
        "last_loss": timing.last_loss,
    }
    if profile is not None:
        row["profile"] = profile
    return row


def _profile(name: str, step: Step, setup: OneGpuSetup) -> dict[str, Any] | None:
    """`profile_steps` of row `name` on a GPU when profiling, its trace kept under ``trace``."""
    if not setup.profile or setup.device.type != "cuda":
        return None
    trace = None if setup.trace is None else Path(setup.trace, f"{name}.json.gz")
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
    return profile_steps(step, trace=trace)


def _print_table(result: dict[str, Any]) -> None:
    rows = result["rows"]
    ref_name = _REFERENCE[result["workload"]]
    ref = rows.get(ref_name, {})

    def cells(name: str, row: dict[str, Any]) -> tuple[str, ...]:
        speed = mem = "n/a"
        if ref.get("status") == "ok":
            speed = f"{row['tokens_per_s'] / ref['tokens_per_s']:.2f}"
            if row["peak_mem_gib"] is not None:
                mem = f"{row['peak_mem_gib'] / ref['peak_mem_gib']:.2f}"
        return (
            name,
            fmt(row["tokens_per_s"], ".0f"),
            fmt(row["peak_mem_gib"], ".1f"),
            fmt(row["step_ms"], ".1f"),
            fmt(row["host_ms"], ".1f"),
            speed,
            mem,
        )

    head = ("row", "tokens/s", "peak GiB", "step ms", "host ms", f"x {ref_name}", f"mem/{ref_name}")
    print_table(head, rows.items(), cells)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=tuple(WORKLOADS), default="lora")
    shapes = tuple(QWEN3_SHAPES) + tuple(s for s in QWEN25_SHAPES if s not in QWEN3_SHAPES)
    p.add_argument("--shape", choices=shapes, default="qwen3-4b")
    p.add_argument("--seq", type=positive_int, default=2048)
    p.add_argument("--batch", type=positive_int, default=4)
    p.add_argument("--rows", nargs="+", default=None, help="default: every row of the workload")
    p.add_argument("--steps", type=positive_int, default=10)
    p.add_argument("--warmup", type=positive_int, default=3)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="every row recomputes each decoder layer in backward",
    )
    p.add_argument(
        "--memory-budget",
        type=float,
        default=None,
        help="the compiled twinkle rows' compile_layers memory_budget (in [0, 1])",
    )
    p.add_argument("--checkpoint", default=None, help="load: default /tmp/twinkle_<shape>_bf16")
    p.add_argument("--parity-steps", type=positive_int, default=200, help="fp8_parity")
    p.add_argument("--parity-samples", type=positive_int, default=512, help="fp8_parity")
    p.add_argument("--profile", action="store_true", help="profile two steps per row (GPU)")
    p.add_argument("--trace", help="profile, and keep each row's profiler trace in this folder")
    p.add_argument("--json", default="one_gpu.json")
    return p


if __name__ == "__main__":
    main()
