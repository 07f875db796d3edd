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
  its ``megatron_optimizer``.

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

Each training row warms up, then takes the median of timed steps (`benchmarks.throughput.time_steps`).
Tokens/s counts ``batch * seq`` tokens a step; peak memory is CUDA's peak allocated bytes over
the steps (what construction left allocated counts; a transient of construction, such as the
transformers backend's float32 module before ``tf.init`` stores a LoRA base in bf16, does not)
in GiB. A failing row (out of memory) is reported
and the run goes on; the JSON is rewritten after every row.

    python -m benchmarks.one_gpu --workload lora --shape qwen3-4b --seq 2048 --batch 4 \\
        --json lora.json
    python -m benchmarks.one_gpu --workload full --shape qwen3-4b --seq 2048 --batch 4 \\
        --json full.json
    python -m benchmarks.one_gpu --workload load --shape qwen3-4b --checkpoint /tmp/qwen3-4b \\
        --json load.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import time
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

import twinkle_fn as tf
from benchmarks.throughput import (
    Setup,
    Step,
    host_batch,
    megatron_world,
    padded_batch,
    release,
    time_steps,
    versions,
)
from twinkle_fn import backends

_QWEN3 = dict(
    model_type="qwen3",
    max_position_embeddings=40960,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
SHAPES = MappingProxyType(
    {
        "tiny": dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        ),
        "qwen3-4b": dict(
            vocab_size=151936,
            hidden_size=2560,
            intermediate_size=9728,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
        ),
    }
)
LORA = MappingProxyType({"r": 16, "lora_alpha": 32, "target_modules": "all-linear"})
WORKLOADS = MappingProxyType(
    {
        "lora": (
            "peft_eager",
            "peft_compiled",
            "twinkle_transformers",
            "twinkle_transformers_compiled",
            "twinkle_megatron",
            "twinkle_megatron_compiled",
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
    }
)
_LR, _WEIGHT_DECAY, _CLIP = 1e-5, 0.01, 1.0


@dataclasses.dataclass(frozen=True)
class OneGpuSetup(Setup):
    """`benchmarks.throughput.Setup`, whether every row recomputes each decoder layer's
    activations in backward (``--activation-checkpointing``), and the compiled twinkle rows'
    ``memory_budget`` (``--memory-budget``; None: compile_layers' default)."""

    activation_checkpointing: bool = False
    memory_budget: float | None = None


def _compiled(setup: OneGpuSetup) -> dict[str, Any]:
    """The ``compile_layers`` option of a compiled twinkle row."""
    if setup.memory_budget is None:
        return {"compile_layers": True}
    return {"compile_layers": {"memory_budget": setup.memory_budget}}


def qwen3_config(shape: str) -> PretrainedConfig:
    """The HF ``Qwen3Config`` of `shape` (a key of `SHAPES`). Raises ``ValueError`` if unknown."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; use one of {', '.join(SHAPES)}")
    return AutoConfig.for_model(**{**_QWEN3, **SHAPES[shape]})


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
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = qwen3_config(args.shape)
    ids = torch.randint(
        0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)
    )
    setup = OneGpuSetup(
        config,
        ids.to(device),
        device,
        "model",
        activation_checkpointing=args.activation_checkpointing,
        memory_budget=args.memory_budget,
    )
    if args.workload == "load":
        return _main_load(args, config, device, rows)
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
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
    for name in rows:
        row = run_row(name, setup, args.warmup, args.steps)
        result["rows"][name] = row
        print(f"{name}: {json.dumps(row)}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
    _print_table(result)
    return result


def run_row(name: str, setup: OneGpuSetup, warmup: int, steps: int) -> dict[str, Any]:
    """One row's measurement, or why it was skipped or failed; its memory is released after."""
    if "_compiled" in name and setup.device.type != "cuda":
        return {"status": "skipped", "reason": "GPU only (compiling on a CPU takes minutes)"}
    if "megatron" in name and "megatron" not in backends.names():
        return {"status": "skipped", "reason": "no megatron backend"}
    release(setup.device)
    try:
        with _ROWS[name](setup) as step:
            if setup.device.type == "cuda":  # the steps' peak: what stays allocated counts
                torch.cuda.reset_peak_memory_stats(setup.device)
            timing = time_steps(step, warmup, steps, setup.device)
            peak = _peak_gib(setup.device)
    except Exception as e:  # a failing row (out of memory) is a result, not a crash
        row = {"status": "error", "error": f"{type(e).__name__}: {e}"[:500]}
    else:
        batch, seq = setup.input_ids.shape
        row = {
            "status": "ok",
            "step_ms": 1e3 * timing.seconds,
            "tokens_per_s": batch * seq / timing.seconds,
            "peak_mem_gib": peak,
            "first_loss": timing.first_loss,
            "last_loss": timing.last_loss,
        }
    release(setup.device)
    return row


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


# --- lora rows ------------------------------------------------------------------------------


def _peft(setup: OneGpuSetup, compiled: bool) -> Step:
    from peft import LoraConfig, get_peft_model

    device, ids = setup.device, setup.input_ids
    torch.manual_seed(0)
    with torch.device(device):
        base = AutoModelForCausalLM.from_config(
            setup.config, dtype=torch.bfloat16, attn_implementation="sdpa"
        ).train()
    if setup.activation_checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(base, LoraConfig(**LORA))
    params = [p for p in model.parameters() if p.requires_grad]
    fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(params, lr=_LR, weight_decay=_WEIGHT_DECAY, **fused)
    forward = torch.compile(model, dynamic=False) if compiled else model

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = forward(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, _CLIP, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def twinkle_step(
    setup: OneGpuSetup,
    backend: str,
    tx: tf.optim.GradientTransformation,
    options: dict[str, Any] | None = None,
    lora: bool = False,
) -> Step:
    """``tf.fwd_bwd`` + ``tf.step`` on `backend` with `tx`, bf16 compute; with `lora`, of a
    LoRA (`LORA`) state."""
    # The megatron backend builds its own bf16 model from the HF module's weights: the module
    # stays on the CPU, or its float32 copy would sit on the GPU through the row.
    place = torch.device("cpu") if backend == "megatron" else setup.device
    model = tf.models.from_hf_config(
        setup.config,
        backend=backend,
        precision="bf16",
        device=place,
        seed=0,
        options=options,
        activation_checkpointing=setup.activation_checkpointing,
    )
    if lora:
        model = tf.lora.add_lora(model, dict(LORA))
    holder = [tf.init(model, tx)]
    batch = host_batch(padded_batch(setup.input_ids.cpu()), setup.device)

    def step() -> torch.Tensor:
        grads, _ = tf.fwd_bwd(holder[0], batch)
        holder[0], info = tf.step(holder[0], grads)
        return info["loss"]

    return step


def _adamw(backend: str) -> tf.optim.GradientTransformation:
    """AdamW with clipping: the optax-style chain, or megatron-core's distributed optimizer."""
    if backend == "megatron":
        from twinkle_fn.optim import megatron_optimizer

        return megatron_optimizer(_LR, weight_decay=_WEIGHT_DECAY, clip_grad=_CLIP)
    return tf.optim.chain(
        tf.optim.clip_by_global_norm(_CLIP), tf.optim.adamw(_LR, weight_decay=_WEIGHT_DECAY)
    )


def _adamw_bf16() -> tf.optim.GradientTransformation:
    return tf.optim.chain(
        tf.optim.clip_by_global_norm(_CLIP), tf.optim.adamw_bf16(_LR, weight_decay=_WEIGHT_DECAY)
    )


@contextlib.contextmanager
def _peft_eager(setup: OneGpuSetup) -> Iterator[Step]:
    yield _peft(setup, compiled=False)


@contextlib.contextmanager
def _peft_compiled(setup: OneGpuSetup) -> Iterator[Step]:
    yield _peft(setup, compiled=True)


@contextlib.contextmanager
def _twinkle_transformers(setup: OneGpuSetup) -> Iterator[Step]:
    yield twinkle_step(setup, "transformers", _adamw("transformers"), lora=True)


@contextlib.contextmanager
def _twinkle_transformers_compiled(setup: OneGpuSetup) -> Iterator[Step]:
    yield twinkle_step(setup, "transformers", _adamw("transformers"), _compiled(setup), lora=True)


@contextlib.contextmanager
def _twinkle_megatron(setup: OneGpuSetup) -> Iterator[Step]:
    with megatron_world(setup.device):
        yield twinkle_step(setup, "megatron", _adamw("megatron"), lora=True)


@contextlib.contextmanager
def _twinkle_megatron_compiled(setup: OneGpuSetup) -> Iterator[Step]:
    with megatron_world(setup.device):
        yield twinkle_step(setup, "megatron", _adamw("megatron"), _compiled(setup), lora=True)


# --- full fine-tuning rows ------------------------------------------------------------------

_NO_MASTERS = {"master_weights": False}


@contextlib.contextmanager
def _full_transformers_adamw(setup: OneGpuSetup) -> Iterator[Step]:
    yield twinkle_step(setup, "transformers", _adamw("transformers"))


@contextlib.contextmanager
def _full_transformers_adamw_bf16(setup: OneGpuSetup) -> Iterator[Step]:
    yield twinkle_step(setup, "transformers", _adamw_bf16(), dict(_NO_MASTERS))


@contextlib.contextmanager
def _full_transformers_adamw_bf16_compiled(setup: OneGpuSetup) -> Iterator[Step]:
    options = {**_NO_MASTERS, **_compiled(setup)}
    yield twinkle_step(setup, "transformers", _adamw_bf16(), options)


@contextlib.contextmanager
def _full_megatron_adamw_bf16(setup: OneGpuSetup) -> Iterator[Step]:
    with megatron_world(setup.device):
        yield twinkle_step(setup, "megatron", _adamw_bf16())


@contextlib.contextmanager
def _full_megatron_adamw_bf16_compiled(setup: OneGpuSetup) -> Iterator[Step]:
    with megatron_world(setup.device):
        yield twinkle_step(setup, "megatron", _adamw_bf16(), _compiled(setup))


@contextlib.contextmanager
def _full_megatron(setup: OneGpuSetup) -> Iterator[Step]:
    with megatron_world(setup.device):
        yield twinkle_step(setup, "megatron", _adamw("megatron"))


_ROWS = MappingProxyType(
    {
        "peft_eager": _peft_eager,
        "peft_compiled": _peft_compiled,
        "twinkle_transformers": _twinkle_transformers,
        "twinkle_transformers_compiled": _twinkle_transformers_compiled,
        "twinkle_megatron": _twinkle_megatron,
        "twinkle_megatron_compiled": _twinkle_megatron_compiled,
        "twinkle_transformers_adamw": _full_transformers_adamw,
        "twinkle_transformers_adamw_bf16": _full_transformers_adamw_bf16,
        "twinkle_transformers_adamw_bf16_compiled": _full_transformers_adamw_bf16_compiled,
        "twinkle_megatron_adamw_bf16": _full_megatron_adamw_bf16,
        "twinkle_megatron_adamw_bf16_compiled": _full_megatron_adamw_bf16_compiled,
        "twinkle_megatron_distopt": _full_megatron,
    }
)


# --- loading rows ---------------------------------------------------------------------------


def write_checkpoint(config: PretrainedConfig, directory: Path) -> int:
    """A random bf16 checkpoint of `config` in `directory` unless one is there; its bytes."""
    if not (directory / "config.json").is_file():
        torch.manual_seed(0)
        module = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        module.save_pretrained(directory)
        del module
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def _warm(directory: Path) -> None:
    """Read every file once, so that each row reads from the page cache alike."""
    for f in sorted(directory.glob("*.safetensors")):
        with f.open("rb", buffering=0) as fh:
            while fh.read(1 << 26):
                pass


def load_row(name: str, directory: Path, device: torch.device) -> dict[str, Any]:
    """Load the checkpoint in `directory` the way row `name` does, timing the load and the
    init; memory released after."""
    if "megatron" in name and "megatron" not in backends.names():
        return {"status": "skipped", "reason": "no megatron backend"}
    release(device)
    backend = name.removeprefix("twinkle_")
    try:
        with megatron_world(device) if backend == "megatron" else contextlib.nullcontext():
            _sync(device)
            start = time.perf_counter()
            if name == "hf_from_pretrained":
                loaded: Any = AutoModelForCausalLM.from_pretrained(
                    directory, dtype=torch.bfloat16, device_map=str(device)
                )
            else:
                loaded = tf.models.from_pretrained(directory, backend=backend, precision="bf16")
            _sync(device)
            load_s = time.perf_counter() - start
            if name != "hf_from_pretrained":
                model = tf.lora.add_lora(loaded, dict(LORA))
                loaded = tf.init(model, _adamw(backend))
            _sync(device)
            total = time.perf_counter() - start
            peak = _peak_gib(device)
            del loaded
    except Exception as e:  # a failing row is a result, not a crash
        row = {"status": "error", "error": f"{type(e).__name__}: {e}"[:500]}
    else:
        row = {"status": "ok", "load_s": load_s, "init_s": total - load_s, "total_s": total}
        row["peak_mem_gib"] = peak
    release(device)
    return row


def _main_load(
    args: argparse.Namespace, config: PretrainedConfig, device: torch.device, rows: list[str]
) -> dict[str, Any]:
    directory = Path(args.checkpoint or f"/tmp/twinkle_{args.shape}_bf16")
    size = write_checkpoint(config, directory)
    _warm(directory)
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "versions": versions(),
        "workload": "load",
        "shape": args.shape,
        "checkpoint": str(directory),
        "checkpoint_gib": size / 2**30,
        "rows": {},
    }
    print(f"load {args.shape}: {size / 2**30:.2f} GiB in {directory} on {result['device_name']}")
    for name in rows:
        row = load_row(name, directory, device)
        if row["status"] == "ok":
            row["gb_per_s"] = size / 1e9 / row["total_s"]
        result["rows"][name] = row
        print(f"{name}: {json.dumps(row)}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- output ---------------------------------------------------------------------------------


# The row the others are compared with, per workload.
_REFERENCE = MappingProxyType({"lora": "peft_compiled", "full": "twinkle_transformers_adamw"})


def _print_table(result: dict[str, Any]) -> None:
    rows = result["rows"]
    name = _REFERENCE[result["workload"]]
    ref = rows.get(name, {})
    print(f"row | tokens/s | peak GiB | step ms | x {name} | mem/{name}")
    for name, row in rows.items():
        if row["status"] != "ok":
            print(f"{name} | {row['status']}: {row.get('error') or row.get('reason')}")
            continue
        speed = mem = "n/a"
        if ref.get("status") == "ok":
            speed = f"{row['tokens_per_s'] / ref['tokens_per_s']:.2f}"
            if row["peak_mem_gib"] is not None:
                mem = f"{row['peak_mem_gib'] / ref['peak_mem_gib']:.2f}"
        peak = "n/a" if row["peak_mem_gib"] is None else f"{row['peak_mem_gib']:.1f}"
        print(
            f"{name} | {row['tokens_per_s']:.0f} | {peak} | {row['step_ms']:.1f} | {speed} | {mem}"
        )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=tuple(WORKLOADS), default="lora")
    p.add_argument("--shape", choices=tuple(SHAPES), default="qwen3-4b")
    p.add_argument("--seq", type=_positive_int, default=2048)
    p.add_argument("--batch", type=_positive_int, default=4)
    p.add_argument("--rows", nargs="+", default=None, help="default: every row of the workload")
    p.add_argument("--steps", type=_positive_int, default=10)
    p.add_argument("--warmup", type=_positive_int, default=3)
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
    p.add_argument("--json", default="one_gpu.json")
    return p


if __name__ == "__main__":
    main()
