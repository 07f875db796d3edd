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
import dataclasses
import datetime
import gc
import json
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from importlib import metadata
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

import twinkle_fn as tf
from benchmarks.profile_summary import format_summary, profile_steps
from twinkle_fn import backends
from twinkle_fn.data import IGNORE_INDEX
from twinkle_fn.mesh import Mesh

_QWEN25 = dict(
    model_type="qwen2",
    max_position_embeddings=32768,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    use_sliding_window=False,
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
        ),
        "qwen2.5-0.5b": dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
        ),
        "qwen2.5-1.5b": dict(
            vocab_size=151936,
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
        ),
    }
)
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
# Dense bf16 tensor-core peak of one H100/H200 SXM (the MFU denominator).
HOPPER_BF16_PEAK = 989e12
MFU_FORMULA = (
    "MFU = tokens/s x (6 x matmul params incl. lm_head + 6 x layers x hidden x seq) / peak"
)
_LR, _WEIGHT_DECAY, _CLIP = 1e-5, 0.01, 1.0


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every row trains: the HF config, the token batch and the run's options."""

    config: PretrainedConfig
    input_ids: torch.Tensor  # [batch, seq] random tokens on the device
    device: torch.device
    compile_scope: str
    profile: bool = False  # also profile two steps per row (`benchmarks.profile_summary`)


Step = Callable[[], torch.Tensor]  # one training step; returns its mean loss (a device tensor)
RowBuilder = Callable[[Setup], contextlib.AbstractContextManager[Step]]


def qwen25_config(shape: str) -> PretrainedConfig:
    """The HF ``Qwen2Config`` of `shape` (a key of `SHAPES`). Raises ``ValueError`` if unknown."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; use one of {', '.join(SHAPES)}")
    return AutoConfig.for_model(**{**_QWEN25, **SHAPES[shape]})


def matmul_params(config: PretrainedConfig) -> int:
    """Weights that take part in a matmul per token: every decoder linear plus the lm_head.

    The embedding lookup is not a matmul; the lm_head counts even when tied to it. Biases and
    norm weights are left out (they add no matmul FLOPs).
    """
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    per_layer = hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * inter
    return config.num_hidden_layers * per_layer + config.vocab_size * hidden


def flops_per_token(config: PretrainedConfig, seq: int) -> int:
    """Training FLOPs per token of `MFU_FORMULA`: ``6 N + 6 L H S``."""
    return 6 * matmul_params(config) + 6 * config.num_hidden_layers * config.hidden_size * seq


def mfu(tokens_per_s: float, flops_per_tok: int, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation (a fraction), or None without a known peak."""
    return None if peak_flops is None else tokens_per_s * flops_per_tok / peak_flops


def main(argv: list[str] | None = None) -> dict:
    """Run the selected rows and return (and print, and write) the results."""
    args = _parser().parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
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
        add_ratios(result["rows"])
        _write(result, args.json)
    _print_table(result)
    return result


def _header(args: argparse.Namespace, config: PretrainedConfig, device: torch.device) -> dict:
    fpt = flops_per_token(config, args.seq)
    peak = args.peak_flops if args.peak_flops is not None else default_peak(device)
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
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


def default_peak(device: torch.device) -> float | None:
    """The dense bf16 peak FLOP/s of `device` when known (H100/H200), else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return HOPPER_BF16_PEAK if ("H100" in name or "H200" in name) else None


def versions() -> dict[str, str | None]:
    """Versions of Python and of the packages a result depends on (None when not installed)."""

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "megatron-core": version("megatron-core"),
        "flash-attn": version("flash-attn"),
        "transformer-engine": version("transformer-engine"),
    }


def _run_row(name: str, setup: Setup, warmup: int, steps: int) -> dict[str, Any]:
    """One row's measurement, or why it was skipped or failed; its memory is released after."""
    if reason := _skip_reason(name, setup.device):
        return {"status": "skipped", "reason": reason}
    release(setup.device)
    try:
        row = _measure(name, setup, warmup, steps)
    except Exception as e:  # a failing row is a result (OOM, missing megatron-core), not a crash
        row = {"status": "error", "error": f"{type(e).__name__}: {e}"[:500]}
    release(setup.device)
    return row


def _measure(name: str, setup: Setup, warmup: int, steps: int) -> dict[str, Any]:
    """Build the row, time it; everything it built is unreachable once this returns."""
    leftover_gib = _allocated_gib(setup.device)  # not 0: an earlier row leaked memory
    with _ROW_BUILDERS[name](setup) as step:
        timing = time_steps(step, warmup, steps, setup.device)
        peak_gib = _peak_gib(setup.device)
        profile = profile_steps(step) if setup.profile and setup.device.type == "cuda" else None
    batch, seq = setup.input_ids.shape
    return {
        "status": "ok",
        "step_ms": 1e3 * timing.seconds,
        "host_ms": 1e3 * timing.host_seconds,
        "tokens_per_s": batch * seq / timing.seconds,
        "peak_mem_gib": peak_gib,
        "first_loss": timing.first_loss,
        "last_loss": timing.last_loss,
        "leftover_gib": leftover_gib,
        "profile": profile,
    }


def _skip_reason(name: str, device: torch.device) -> str | None:
    if "_compiled" in name and device.type != "cuda":
        return "GPU only (compiling on a CPU takes minutes)"
    if name.startswith("twinkle_megatron") and "megatron" not in backends.names():
        return "twinkle_fn.backends has no 'megatron' backend yet"
    return None


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
        _sync(device)
        start = time.perf_counter()
        loss = step()
        host.append(time.perf_counter() - start)
        _sync(device)
        samples.append(time.perf_counter() - start)
    return StepTiming(statistics.median(samples), statistics.median(host), first, float(loss))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Free what the last row left (compiled graphs, cached blocks) and reset the peak."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _allocated_gib(device: torch.device) -> float | None:
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None


def add_ratios(rows: dict[str, dict[str, Any]], baselines: Sequence[str] = BASELINES) -> None:
    """Speed-ups (tokens/s over each of `baselines`') and peak memory over the compiled loop's
    (``hf_compiled``), written into each ok row as ``x_<baseline>`` and ``mem_vs_hf_compiled``
    (None where the reference did not run)."""
    for row in rows.values():
        if row["status"] != "ok":
            continue
        for base in baselines:
            ref = rows.get(base, {})
            ok = ref.get("status") == "ok"
            row[f"x_{base}"] = row["tokens_per_s"] / ref["tokens_per_s"] if ok else None
        ref = rows.get("hf_compiled", {})
        ok = ref.get("status") == "ok" and row["peak_mem_gib"] is not None
        row["mem_vs_hf_compiled"] = row["peak_mem_gib"] / ref["peak_mem_gib"] if ok else None


# --- rows ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _hf_loop(setup: Setup) -> Iterator[Step]:
    yield _hf_step(setup, compile_scope=None)


@contextlib.contextmanager
def _hf_compiled(setup: Setup) -> Iterator[Step]:
    yield _hf_step(setup, compile_scope=setup.compile_scope)


def _hf_step(setup: Setup, compile_scope: str | None) -> Step:
    device, ids = setup.device, setup.input_ids
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            setup.config, dtype=torch.float32, attn_implementation="sdpa"
        ).train()
    params = list(model.parameters())
    fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(params, lr=_LR, weight_decay=_WEIGHT_DECAY, **fused)
    if compile_scope == "layer":
        for layer in model.model.layers:
            layer.compile(dynamic=False)
    forward = torch.compile(model, dynamic=False) if compile_scope == "model" else model

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = forward(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, _CLIP, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


@contextlib.contextmanager
def _mcore_local(setup: Setup) -> Iterator[Step]:
    with megatron_world(setup.device):
        yield _mcore_step(setup, our_spec=False)


@contextlib.contextmanager
def _mcore_sdpa(setup: Setup) -> Iterator[Step]:
    with megatron_world(setup.device):
        yield _mcore_step(setup, our_spec=True)


def _mcore_step(setup: Setup, our_spec: bool) -> Step:
    """megatron-core's own training path: bf16 GPTModel, DDP, distributed optimizer."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from twinkle_fn.backends.megatron.bridge_transforms import padded_vocab_size
    from twinkle_fn.backends.megatron.config import transformer_config
    from twinkle_fn.backends.megatron.model import build_gpt_model, rope_settings

    cfg, mesh = setup.config, Mesh()
    # megatron-core's own defaults for its fusions (all off), not the twinkle backend's (on with
    # CUDA), so that these rows stay the raw baseline measured before the backend gained them.
    kw = dict(
        params_dtype=torch.bfloat16,
        bf16=True,
        finalize_model_grads_func=finalize_model_grads,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
    )
    if our_spec:
        model = build_gpt_model(cfg, mesh, **kw)
    else:
        model = GPTModel(
            transformer_config(cfg, mesh, **kw),
            get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=padded_vocab_size(cfg.vocab_size, 1),
            max_sequence_length=cfg.max_position_embeddings,
            share_embeddings_and_output_weights=bool(cfg.tie_word_embeddings),
            position_embedding_type="rope",
            rotary_base=rope_settings(cfg)[0],
        ).to(setup.device)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True
    )
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=_LR,
            weight_decay=_WEIGHT_DECAY,
            bf16=True,
            use_distributed_optimizer=True,
            clip_grad=_CLIP,
        ),
        [ddp],
    )
    ids = setup.input_ids  # [batch, seq]
    batch, seq = ids.shape
    positions = torch.arange(seq, device=ids.device).expand(batch, seq)
    labels = ids.roll(-1, dims=1)  # the next token; the wrapped last column is masked out
    mask = torch.ones(batch, seq, device=ids.device)
    mask[:, -1] = 0
    forward_backward = get_forward_backward_func()

    def loss_func(per_token: torch.Tensor):
        loss_sum = (per_token.float() * mask).sum()
        num = mask.sum().to(torch.int)
        return loss_sum, num, {"loss": (loss_sum / num).detach()}

    def forward_step(_, module):
        return module(ids, positions, None, labels=labels), loss_func

    def step() -> torch.Tensor:
        ddp.zero_grad_buffer()
        opt.zero_grad()
        out = forward_backward(
            forward_step_func=forward_step,
            data_iterator=None,
            model=[ddp],
            num_microbatches=1,
            seq_length=seq,
            micro_batch_size=batch,
        )
        opt.step()
        return out[0]["loss"]

    return step


@contextlib.contextmanager
def _twinkle_fsdp(setup: Setup) -> Iterator[Step]:
    yield _twinkle_step(setup, backend="transformers")


@contextlib.contextmanager
def _twinkle_fsdp_compiled(setup: Setup) -> Iterator[Step]:
    yield _twinkle_step(setup, backend="transformers", options={"compile_layers": True})


@contextlib.contextmanager
def _twinkle_fsdp_compiled_ckpt(setup: Setup) -> Iterator[Step]:
    yield _twinkle_step(
        setup,
        backend="transformers",
        options={"compile_layers": True},
        activation_checkpointing=True,
    )


@contextlib.contextmanager
def _twinkle_fsdp_compiled_budget(setup: Setup) -> Iterator[Step]:
    options = {"compile_layers": {"memory_budget": 0.6}}
    yield _twinkle_step(setup, backend="transformers", options=options)


@contextlib.contextmanager
def _twinkle_megatron(setup: Setup) -> Iterator[Step]:
    with megatron_world(setup.device):
        yield _twinkle_step(setup, backend="megatron")


@contextlib.contextmanager
def _twinkle_megatron_compiled(setup: Setup) -> Iterator[Step]:
    with megatron_world(setup.device):
        yield _twinkle_step(setup, backend="megatron", options={"compile_layers": True})


def _twinkle_step(
    setup: Setup,
    backend: str,
    options: dict[str, Any] | None = None,
    activation_checkpointing: bool = False,
    batch: dict[str, Any] | None = None,
    lora: dict[str, Any] | None = None,
) -> Step:
    """``tf.fwd_bwd`` + ``tf.step`` on `backend`; `batch` (a host batch) defaults to the
    padded full rows of ``setup.input_ids``; `lora` (``LoraConfig`` fields) trains an adapter."""
    # The megatron backend builds its own model and reads the HF module's weights once: the
    # module stays on the CPU (the model's default there), or its float32 copy of every weight
    # (4 bytes a parameter) would sit on the GPU through the row, counted in its peak.
    place = torch.device("cpu") if backend == "megatron" else setup.device
    with torch.device(place):
        model = tf.models.from_hf_config(
            setup.config,
            backend=backend,
            precision="bf16",
            device=place,
            seed=0,
            options=options,
            activation_checkpointing=activation_checkpointing,
        )
    if lora is not None:
        model = tf.lora.add_lora(model, lora)
    holder = [tf.init(model, twinkle_optimizer(backend))]
    if batch is None:
        batch = host_batch(padded_batch(setup.input_ids.cpu()), setup.device)

    def step() -> torch.Tensor:
        grads, _ = tf.fwd_bwd(holder[0], batch)
        holder[0], info = tf.step(holder[0], grads)
        return info["loss"]

    return step


def twinkle_optimizer(backend: str) -> tf.optim.GradientTransformation:
    """AdamW with clipping: the optax-style chain, or on the megatron backend the transform its
    docs name for it (megatron-core's distributed optimizer, as in the ``mcore_*`` rows)."""
    if backend == "megatron":
        from twinkle_fn.optim import megatron_optimizer

        return megatron_optimizer(_LR, weight_decay=_WEIGHT_DECAY, clip_grad=_CLIP)
    return tf.optim.chain(
        tf.optim.clip_by_global_norm(_CLIP), tf.optim.adamw(_LR, weight_decay=_WEIGHT_DECAY)
    )


def padded_batch(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """A `twinkle_fn.data.pad_collate`-style batch of full-length rows of `ids` ``[batch, seq]``.

    Labels are the next tokens (the last position unsupervised), so every row of the benchmark
    trains on the same ``batch * (seq - 1)`` targets.
    """
    batch, seq = ids.shape
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = ids[:, 1:]
    return {
        "input_ids": ids,
        "labels": labels,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(seq, device=ids.device).expand(batch, seq),
    }


def host_batch(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """`batch` on the host, as a data loader hands it over: in pinned memory when `device` is a
    GPU, so each step's copy to the device is asynchronous (the step does not wait for it)."""
    if device.type != "cuda":
        return batch
    # contiguous: an expanded tensor (position_ids) pinned as it is would be copied into a
    # device tensor whose elements overlap
    # (a packed batch's max_seqlen is an int, and stays one)
    return {
        k: v.contiguous().pin_memory() if isinstance(v, torch.Tensor) else v
        for k, v in batch.items()
    }


@contextlib.contextmanager
def megatron_world(device: torch.device) -> Iterator[None]:
    """A one-rank process group (NCCL on GPU, gloo on CPU) with megatron-core's state on it.

    On a CPU `twinkle_fn.backends.megatron.parallel.initialize` enables `cpu_compat`; both are undone on
    exit, as is a process group this made.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from twinkle_fn.backends.megatron import parallel
    from twinkle_fn.testing_dist import free_port

    made_group = not dist.is_initialized()
    if made_group:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
        )
    made_state = not parallel_state.model_parallel_is_initialized()
    try:
        if made_state:
            parallel.initialize(Mesh(), seed=0)
        yield
    finally:
        if made_state:
            parallel.destroy()
        if made_group:
            dist.destroy_process_group()


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


def _write(result: dict, path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(result, indent=2))


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
    if row["status"] == "ok":
        print(
            f"{name}: {row['tokens_per_s']:.0f} tokens/s, {row['step_ms']:.1f} ms/step, "
            f"loss {row['first_loss']:.3f} -> {row['last_loss']:.3f}",
            flush=True,
        )
        if row.get("profile"):
            print(f"  {format_summary(row['profile'])}", flush=True)
    else:
        print(f"{name}: {row['status']}: {row.get('error') or row.get('reason')}", flush=True)


def _fmt(value: float | None, spec: str, scale: float = 1.0, unit: str = "") -> str:
    return "n/a" if value is None else format(value * scale, spec) + unit


def _print_table(result: dict) -> None:
    head = ("row", "tokens/s", "MFU", "peak GiB", "step ms", "x hf_loop", "x compiled", "x mcore")
    print(" | ".join((*head, "mem/compiled")))
    for name in sorted(result["rows"], key=ROWS.index):
        row = result["rows"][name]
        if row["status"] != "ok":
            print(f"{name} | {row['status']}: {row.get('error') or row.get('reason')}")
            continue
        cells = (
            name,
            _fmt(row["tokens_per_s"], ".0f"),
            _fmt(row["mfu"], ".1f", 100.0, "%"),
            _fmt(row["peak_mem_gib"], ".1f"),
            _fmt(row["step_ms"], ".1f"),
            *(_fmt(row[f"x_{base}"], ".2f") for base in BASELINES),
            _fmt(row["mem_vs_hf_compiled"], ".2f"),
        )
        print(" | ".join(cells))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--seq", type=_positive_int, default=2048)
    p.add_argument("--batch", type=_positive_int, default=8)
    p.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    p.add_argument("--steps", type=_positive_int, default=10)
    p.add_argument("--warmup", type=_positive_int, default=3)
    p.add_argument("--compile", choices=("model", "layer"), default="model")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--peak-flops", type=float, default=None, help="default: 989e12 on H100/H200")
    p.add_argument("--json", default="throughput.json")
    p.add_argument("--profile", action="store_true", help="profile two steps per row (GPU)")
    return p


if __name__ == "__main__":
    main()
