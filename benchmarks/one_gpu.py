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
the bf16 peak (`benchmarks.throughput.MFU_FORMULA`: the bf16 FLOPs the step does, so an fp8
row's MFU is its speed-up over bf16 in the same units, not a utilisation of the fp8 peak).

``--workload fp8_parity``: the same rows trained ``--parity-steps`` steps (default 200) on the
built-in arithmetic chat data (character tokens, ``--parity-samples`` samples packed into one
row a step, lr 1e-4 after 10 warm-up steps), every row on the same batches. Each row reports its
loss curve and final loss (the mean of the last 10 steps) and each fp8 row the difference from
its backend's bf16 row of the same compilation (``loss_diff_vs_bf16``: final; ``max_loss_diff``:
the largest difference of 10-step means along the curve).

Each training row warms up, then takes the median of timed steps (`benchmarks.throughput.time_steps`).
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
from benchmarks import throughput
from benchmarks.profile_summary import format_summary, profile_steps
from benchmarks.throughput import (
    Setup,
    Step,
    default_peak,
    flops_per_token,
    host_batch,
    megatron_world,
    mfu,
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
FP8_ROWS = tuple(
    f"twinkle_{backend}_{kind}"
    for backend in ("transformers", "megatron")
    for kind in ("bf16", "fp8", "bf16_compiled", "fp8_compiled", "fp8_tensorwise_compiled")
)
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
PARITY_WARMUP, PARITY_LR, PARITY_MEAN = 10, 1e-4, 10
_LR, _WEIGHT_DECAY, _CLIP = 1e-5, 0.01, 1.0


@dataclasses.dataclass(frozen=True)
class OneGpuSetup(Setup):
    """`benchmarks.throughput.Setup`, whether every row recomputes each decoder layer's
    activations in backward (``--activation-checkpointing``), the compiled twinkle rows'
    ``memory_budget`` (``--memory-budget``; None: compile_layers' default), the host batches
    a row steps through in order (``fp8_parity``; empty: ``input_ids`` every step), and the
    folder where a profiled row keeps its trace (``--trace``; None: not kept)."""

    activation_checkpointing: bool = False
    memory_budget: float | None = None
    batches: tuple[dict[str, Any], ...] = ()
    trace: str | None = None


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


def shape_config(shape: str) -> PretrainedConfig:
    """`qwen3_config` of a key of `SHAPES`, else `benchmarks.throughput.qwen25_config` (the
    Qwen2.5 shapes the dense rows measure). Raises ``ValueError`` for a shape of neither."""
    return qwen3_config(shape) if shape in SHAPES else throughput.qwen25_config(shape)


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
        return _main_load(args, config, device, rows)
    if args.workload == "fp8_parity":
        return _main_parity(args, setup, rows)
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
    peak = default_peak(device)
    for name in rows:
        row = run_row(name, setup, args.warmup, args.steps)
        if row["status"] == "ok":  # bf16 FLOPs over the bf16 peak, fp8 rows included
            row["mfu"] = mfu(row["tokens_per_s"], flops_per_token(config, args.seq), peak)
        result["rows"][name] = row
        add_speedups(result["rows"])
        print(f"{name}: {json.dumps({k: v for k, v in row.items() if k != 'profile'})}", flush=True)
        if row.get("profile"):
            print(f"  {format_summary(row['profile'])}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
    _print_table(result)
    return result


def _skipped(name: str, device: torch.device) -> dict[str, Any] | None:
    """Why row `name` does not run on `device`, or None when it does."""
    if "_compiled" in name and device.type != "cuda":
        return {"status": "skipped", "reason": "GPU only (compiling on a CPU takes minutes)"}
    if "megatron" in name and "megatron" not in backends.names():
        return {"status": "skipped", "reason": "no megatron backend"}
    return None


def run_row(name: str, setup: OneGpuSetup, warmup: int, steps: int) -> dict[str, Any]:
    """One row's measurement, or why it was skipped or failed; its memory is released after."""
    skipped = _skipped(name, setup.device)
    if skipped is not None:
        return skipped
    release(setup.device)
    try:
        with _ROWS[name](setup) as step:
            if setup.device.type == "cuda":  # the steps' peak: what stays allocated counts
                torch.cuda.reset_peak_memory_stats(setup.device)
            timing = time_steps(step, warmup, steps, setup.device)
            peak = _peak_gib(setup.device)
            profile = _profile(name, step, setup)
    except Exception as e:  # a failing row (out of memory) is a result, not a crash
        row = {"status": "error", "error": f"{type(e).__name__}: {e}"[:500]}
    else:
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
    release(setup.device)
    return row


def _profile(name: str, step: Step, setup: OneGpuSetup) -> dict[str, Any] | None:
    """`profile_steps` of row `name` on a GPU when profiling, its trace kept under ``trace``."""
    if not setup.profile or setup.device.type != "cuda":
        return None
    trace = None if setup.trace is None else Path(setup.trace, f"{name}.json.gz")
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
    return profile_steps(step, trace=trace)


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
    batches = setup.batches or (padded_batch(setup.input_ids.cpu()),)
    batches = [host_batch(b, setup.device) for b in batches]
    count = [0]

    def step() -> torch.Tensor:
        batch = batches[count[0] % len(batches)]
        count[0] += 1
        grads, _ = tf.fwd_bwd(holder[0], batch)
        holder[0], info = tf.step(holder[0], grads)
        return info["loss"]

    return step


def _adamw(backend: str, lr: Any = _LR) -> tf.optim.GradientTransformation:
    """AdamW with clipping at learning rate `lr` (a float or a schedule): the optax-style chain,
    or megatron-core's distributed optimizer."""
    if backend == "megatron":
        from twinkle_fn.optim import megatron_optimizer

        return megatron_optimizer(lr, weight_decay=_WEIGHT_DECAY, clip_grad=_CLIP)
    return tf.optim.chain(
        tf.optim.clip_by_global_norm(_CLIP), tf.optim.adamw(lr, weight_decay=_WEIGHT_DECAY)
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


@contextlib.contextmanager
def _twinkle_transformers_compiled_fp8(setup: OneGpuSetup) -> Iterator[Step]:
    options = {**_compiled(setup), "fp8": "tensorwise"}
    yield twinkle_step(setup, "transformers", _adamw("transformers"), options, lora=True)


@contextlib.contextmanager
def _twinkle_megatron_compiled_fp8(setup: OneGpuSetup) -> Iterator[Step]:
    options = {**_compiled(setup), "fp8": "tensorwise"}
    with megatron_world(setup.device):
        yield twinkle_step(setup, "megatron", _adamw("megatron"), options, lora=True)


@contextlib.contextmanager
def _twinkle_transformers_compiled_fp8_stored(setup: OneGpuSetup) -> Iterator[Step]:
    options = {**_compiled(setup), "fp8": "tensorwise", "fp8_store_frozen": True}
    yield twinkle_step(setup, "transformers", _adamw("transformers"), options, lora=True)


@contextlib.contextmanager
def _twinkle_megatron_compiled_fp8_stored(setup: OneGpuSetup) -> Iterator[Step]:
    options = {**_compiled(setup), "fp8": "tensorwise", "fp8_store_frozen": True}
    with megatron_world(setup.device):
        yield twinkle_step(setup, "megatron", _adamw("megatron"), options, lora=True)


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


# --- fp8 rows -------------------------------------------------------------------------------


def _fp8_row(backend: str, kind: str) -> Any:
    """The builder of row ``twinkle_<backend>_<kind>``: AdamW full fine-tuning in bf16, with
    the option ``fp8`` (rowwise, or tensorwise) when `kind` names it, compiled when it says so.
    ``fp8_parity`` rows train at ``PARITY_LR`` after ``PARITY_WARMUP`` steps."""
    options: dict[str, Any] = {}
    if kind.startswith("fp8"):
        options["fp8"] = "tensorwise" if "tensorwise" in kind else "rowwise"
    if kind.endswith("_compiled"):
        options["compile_layers"] = True

    @contextlib.contextmanager
    def build(setup: OneGpuSetup) -> Iterator[Step]:
        tx = _adamw(backend)
        if setup.batches:
            steps = len(setup.batches)
            warmup = min(PARITY_WARMUP, steps - 1)
            lr = tf.schedules.warmup_linear(PARITY_LR, warmup, steps, min_lr=PARITY_LR)
            tx = _adamw(backend, lr)
        with megatron_world(setup.device) if backend == "megatron" else contextlib.nullcontext():
            yield twinkle_step(setup, backend, tx, dict(options))

    return build


_ROWS = MappingProxyType(
    {
        "peft_eager": _peft_eager,
        "peft_compiled": _peft_compiled,
        "twinkle_transformers": _twinkle_transformers,
        "twinkle_transformers_compiled": _twinkle_transformers_compiled,
        "twinkle_megatron": _twinkle_megatron,
        "twinkle_megatron_compiled": _twinkle_megatron_compiled,
        "twinkle_transformers_compiled_fp8": _twinkle_transformers_compiled_fp8,
        "twinkle_megatron_compiled_fp8": _twinkle_megatron_compiled_fp8,
        "twinkle_transformers_compiled_fp8_stored": _twinkle_transformers_compiled_fp8_stored,
        "twinkle_megatron_compiled_fp8_stored": _twinkle_megatron_compiled_fp8_stored,
        "twinkle_transformers_adamw": _full_transformers_adamw,
        "twinkle_transformers_adamw_bf16": _full_transformers_adamw_bf16,
        "twinkle_transformers_adamw_bf16_compiled": _full_transformers_adamw_bf16_compiled,
        "twinkle_megatron_adamw_bf16": _full_megatron_adamw_bf16,
        "twinkle_megatron_adamw_bf16_compiled": _full_megatron_adamw_bf16_compiled,
        "twinkle_megatron_distopt": _full_megatron,
        **{name: _fp8_row(*name.split("_", 2)[1:]) for name in FP8_ROWS},
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
        print(f"{name}: {json.dumps({k: v for k, v in row.items() if k != 'profile'})}", flush=True)
        if row.get("profile"):
            print(f"  {format_summary(row['profile'])}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
    return result


# --- fp8 loss parity ------------------------------------------------------------------------


def parity_batches(steps: int, samples: int, seed: int = 0) -> tuple[dict[str, Any], ...]:
    """`steps` packed rows of `samples` built-in arithmetic chat samples each (character
    tokens: ids below 128, within every shape's vocabulary), all different."""
    from twinkle_fn.data import arithmetic_dataset, char_tokenizer, encode_rows, pack

    features = encode_rows(char_tokenizer(), arithmetic_dataset(steps * samples, seed))
    return tuple(pack(features[i * samples : (i + 1) * samples]) for i in range(steps))


def parity_row(name: str, setup: OneGpuSetup) -> dict[str, Any]:
    """Row `name` trained on each of ``setup.batches`` once: its loss curve and final loss (the
    mean of the last `PARITY_MEAN` steps), or why it was skipped or failed."""
    skipped = _skipped(name, setup.device)
    if skipped is not None:
        return skipped
    release(setup.device)
    try:
        with _ROWS[name](setup) as step:
            start = time.perf_counter()
            losses = [float(step()) for _ in setup.batches]
            seconds = time.perf_counter() - start
    except Exception as e:  # a failing row is a result, not a crash
        row = {"status": "error", "error": f"{type(e).__name__}: {e}"[:500]}
    else:
        tail = losses[-PARITY_MEAN:]
        row = {"status": "ok", "seconds": seconds, "final_loss": sum(tail) / len(tail)}
        row["losses"] = losses
    release(setup.device)
    return row


def bf16_row(name: str) -> str | None:
    """The bf16 row an fp8 row `name` is compared with (its backend's, compiled alike); None
    for a row that is not an fp8 row."""
    backend_kind = name.split("_", 2)
    if len(backend_kind) < 3 or not backend_kind[2].startswith("fp8"):
        return None
    compiled = "_compiled" if name.endswith("_compiled") else ""
    return f"twinkle_{backend_kind[1]}_bf16{compiled}"


def add_speedups(rows: dict[str, dict[str, Any]]) -> None:
    """Write into each ok fp8 row ``x_bf16`` (its tokens/s over its `bf16_row`'s) and
    ``mem_vs_bf16`` (peak memory over that row's; None on a CPU), where that row ran."""
    for name, row in rows.items():
        ref = rows.get(bf16_row(name) or "")
        if row["status"] != "ok" or not ref or ref["status"] != "ok":
            continue
        row["x_bf16"] = row["tokens_per_s"] / ref["tokens_per_s"]
        mem = row["peak_mem_gib"], ref["peak_mem_gib"]
        row["mem_vs_bf16"] = None if None in mem else mem[0] / mem[1]


def add_parity_diffs(rows: dict[str, dict[str, Any]]) -> None:
    """Write into each ok fp8 row ``loss_diff_vs_bf16`` (its final loss minus that of the bf16
    row of its backend and compilation) and ``max_loss_diff`` (the largest absolute difference
    of their `PARITY_MEAN`-step means along the curves), where that bf16 row ran."""
    for name, row in rows.items():
        ref = rows.get(bf16_row(name) or "")
        if row["status"] != "ok" or not ref or ref["status"] != "ok":
            continue
        row["loss_diff_vs_bf16"] = row["final_loss"] - ref["final_loss"]
        means = [_means(row["losses"]), _means(ref["losses"])]
        row["max_loss_diff"] = max(abs(a - b) for a, b in zip(*means, strict=True))


def _means(losses: list[float]) -> list[float]:
    n = min(PARITY_MEAN, len(losses))
    return [sum(losses[i : i + n]) / n for i in range(len(losses) - n + 1)]


def _main_parity(args: argparse.Namespace, setup: OneGpuSetup, rows: list[str]) -> dict[str, Any]:
    batches = parity_batches(args.parity_steps, args.parity_samples)
    setup = dataclasses.replace(setup, batches=batches)
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device_name": torch.cuda.get_device_name() if setup.device.type == "cuda" else "cpu",
        "versions": versions(),
        "workload": "fp8_parity",
        "shape": args.shape,
        "steps": args.parity_steps,
        "samples_per_step": args.parity_samples,
        "tokens_per_step": sum(int(b["input_ids"].numel()) for b in batches) / len(batches),
        "lr": PARITY_LR,
        "warmup_steps": min(PARITY_WARMUP, args.parity_steps - 1),
        "rows": {},
    }
    print(f"fp8_parity {args.shape}: {args.parity_steps} steps on {result['device_name']}")
    for name in rows:
        result["rows"][name] = parity_row(name, setup)
        add_parity_diffs(result["rows"])
        row = {k: v for k, v in result["rows"][name].items() if k != "losses"}
        print(f"{name}: {json.dumps(row)}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- output ---------------------------------------------------------------------------------


# The row the others are compared with, per workload.
_REFERENCE = MappingProxyType(
    {
        "lora": "peft_compiled",
        "full": "twinkle_transformers_adamw",
        "fp8": "twinkle_transformers_bf16_compiled",
    }
)


def _print_table(result: dict[str, Any]) -> None:
    rows = result["rows"]
    name = _REFERENCE[result["workload"]]
    ref = rows.get(name, {})
    print(f"row | tokens/s | peak GiB | step ms | host ms | x {name} | mem/{name}")
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
            f"{name} | {row['tokens_per_s']:.0f} | {peak} | {row['step_ms']:.1f} | {row['host_ms']:.1f} | {speed} | {mem}"
        )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=tuple(WORKLOADS), default="lora")
    shapes = tuple(SHAPES) + tuple(s for s in throughput.SHAPES if s not in SHAPES)
    p.add_argument("--shape", choices=shapes, default="qwen3-4b")
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
    p.add_argument("--parity-steps", type=_positive_int, default=200, help="fp8_parity")
    p.add_argument("--parity-samples", type=_positive_int, default=512, help="fp8_parity")
    p.add_argument("--profile", action="store_true", help="profile two steps per row (GPU)")
    p.add_argument("--trace", help="profile, and keep each row's profiler trace in this folder")
    p.add_argument("--json", default="one_gpu.json")
    return p


if __name__ == "__main__":
    main()
