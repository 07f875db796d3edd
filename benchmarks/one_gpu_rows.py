"""The training rows of `benchmarks.one_gpu` (its module docstring says what each measures):
`ROWS` maps a row's name to the builder of its step from a `OneGpuSetup`, for the ``lora``,
``full`` and ``fp8`` workloads (``fp8_parity`` trains the fp8 rows on its own batches)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from types import MappingProxyType
from typing import Any

import torch

import twinkle_fn as tf
from benchmarks.timing import Step, skipped_row
from benchmarks.training import (
    CLIP,
    LR,
    WEIGHT_DECAY,
    Setup,
    backend_world,
    hf_loop_step,
    hf_model,
    megatron_world,
    twinkle_optimizer,
    twinkle_step,
)

LORA = MappingProxyType({"r": 16, "lora_alpha": 32, "target_modules": "all-linear"})
FP8_ROWS = tuple(
    f"twinkle_{backend}_{kind}"
    for backend in ("transformers", "megatron")
    for kind in ("bf16", "fp8", "bf16_compiled", "fp8_compiled", "fp8_tensorwise_compiled")
)
PARITY_WARMUP, PARITY_LR = 10, 1e-4


@dataclasses.dataclass(frozen=True)
class OneGpuSetup(Setup):
    """`benchmarks.training.Setup`, whether every row recomputes each decoder layer's
    activations in backward (``--activation-checkpointing``), the compiled twinkle rows'
    ``memory_budget`` (``--memory-budget``; None: compile_layers' default), the host batches
    a row steps through in order (``fp8_parity``; empty: ``input_ids`` every step), and the
    folder where a profiled row keeps its trace (``--trace``; None: not kept)."""

    activation_checkpointing: bool = False
    memory_budget: float | None = None
    batches: tuple[dict[str, Any], ...] = ()
    trace: str | None = None


def skipped(name: str, device: torch.device) -> dict[str, Any] | None:
    """Why row `name` does not run on `device` (`benchmarks.timing.skipped_row`), or None."""
    return skipped_row(name, device, "no megatron backend")


def one_gpu_step(
    setup: OneGpuSetup,
    backend: str,
    tx: tf.optim.GradientTransformation,
    options: dict[str, Any] | None = None,
    lora: bool = False,
) -> Step:
    """`benchmarks.training.twinkle_step` on `backend` with `tx` and the setup's activation
    checkpointing and batches; with `lora`, of a LoRA (`LORA`) state."""
    return twinkle_step(
        setup,
        backend,
        options,
        tx=tx,
        activation_checkpointing=setup.activation_checkpointing,
        lora=dict(LORA) if lora else None,
        batches=setup.batches,
        init_on_device=False,  # the host's random init, which these rows were measured with
    )


def _compiled(setup: OneGpuSetup) -> dict[str, Any]:
    """The ``compile_layers`` option of a compiled twinkle row."""
    if setup.memory_budget is None:
        return {"compile_layers": True}
    return {"compile_layers": {"memory_budget": setup.memory_budget}}


def _adamw_bf16() -> tf.optim.GradientTransformation:
    return tf.optim.chain(
        tf.optim.clip_by_global_norm(CLIP), tf.optim.adamw_bf16(LR, weight_decay=WEIGHT_DECAY)
    )


# --- lora rows ------------------------------------------------------------------------------


def _peft(setup: OneGpuSetup, compiled: bool) -> Step:
    from peft import LoraConfig, get_peft_model

    base = hf_model(setup, torch.bfloat16)
    if setup.activation_checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(base, LoraConfig(**LORA))
    params = [p for p in model.parameters() if p.requires_grad]
    forward = torch.compile(model, dynamic=False) if compiled else model
    return hf_loop_step(forward, params, setup)


@contextlib.contextmanager
def _peft_eager(setup: OneGpuSetup) -> Iterator[Step]:
    yield _peft(setup, compiled=False)


@contextlib.contextmanager
def _peft_compiled(setup: OneGpuSetup) -> Iterator[Step]:
    yield _peft(setup, compiled=True)


def _lora(backend: str, compiled: bool = False, **fp8: Any) -> Any:
    """The builder of a twinkle LoRA row on `backend`: AdamW over the adapters, each decoder
    layer compiled when `compiled`, the `fp8` options (``fp8``, ``fp8_store_frozen``) added."""

    @contextlib.contextmanager
    def build(setup: OneGpuSetup) -> Iterator[Step]:
        options = {**(_compiled(setup) if compiled else {}), **fp8} or None
        with backend_world(backend, setup.device):
            yield one_gpu_step(setup, backend, twinkle_optimizer(backend), options, lora=True)

    return build


# --- full fine-tuning rows ------------------------------------------------------------------

_NO_MASTERS = {"master_weights": False}


@contextlib.contextmanager
def _full_transformers_adamw(setup: OneGpuSetup) -> Iterator[Step]:
    yield one_gpu_step(setup, "transformers", twinkle_optimizer("transformers"))


@contextlib.contextmanager
def _full_transformers_adamw_bf16(setup: OneGpuSetup) -> Iterator[Step]:
    yield one_gpu_step(setup, "transformers", _adamw_bf16(), dict(_NO_MASTERS))


@contextlib.contextmanager
def _full_transformers_adamw_bf16_compiled(setup: OneGpuSetup) -> Iterator[Step]:
    options = {**_NO_MASTERS, **_compiled(setup)}
    yield one_gpu_step(setup, "transformers", _adamw_bf16(), options)


@contextlib.contextmanager
def _full_megatron_adamw_bf16(setup: OneGpuSetup) -> Iterator[Step]:
    with megatron_world(setup.device):
        yield one_gpu_step(setup, "megatron", _adamw_bf16())


@contextlib.contextmanager
def _full_megatron_adamw_bf16_compiled(setup: OneGpuSetup) -> Iterator[Step]:
    with megatron_world(setup.device):
        yield one_gpu_step(setup, "megatron", _adamw_bf16(), _compiled(setup))


@contextlib.contextmanager
def _full_megatron(setup: OneGpuSetup) -> Iterator[Step]:
    with megatron_world(setup.device):
        yield one_gpu_step(setup, "megatron", twinkle_optimizer("megatron"))


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
        tx = twinkle_optimizer(backend)
        if setup.batches:
            steps = len(setup.batches)
            warmup = min(PARITY_WARMUP, steps - 1)
            lr = tf.schedules.warmup_linear(PARITY_LR, warmup, steps, min_lr=PARITY_LR)
            tx = twinkle_optimizer(backend, lr)
        with backend_world(backend, setup.device):
            yield one_gpu_step(setup, backend, tx, dict(options))

    return build


_TENSORWISE = {"fp8": "tensorwise"}
_STORED = {**_TENSORWISE, "fp8_store_frozen": True}
ROWS = MappingProxyType(
    {
        "peft_eager": _peft_eager,
        "peft_compiled": _peft_compiled,
        "twinkle_transformers": _lora("transformers"),
        "twinkle_transformers_compiled": _lora("transformers", compiled=True),
        "twinkle_megatron": _lora("megatron"),
        "twinkle_megatron_compiled": _lora("megatron", compiled=True),
        "twinkle_transformers_compiled_fp8": _lora("transformers", True, **_TENSORWISE),
        "twinkle_megatron_compiled_fp8": _lora("megatron", True, **_TENSORWISE),
        "twinkle_transformers_compiled_fp8_stored": _lora("transformers", True, **_STORED),
        "twinkle_megatron_compiled_fp8_stored": _lora("megatron", True, **_STORED),
        "twinkle_transformers_adamw": _full_transformers_adamw,
        "twinkle_transformers_adamw_bf16": _full_transformers_adamw_bf16,
        "twinkle_transformers_adamw_bf16_compiled": _full_transformers_adamw_bf16_compiled,
        "twinkle_megatron_adamw_bf16": _full_megatron_adamw_bf16,
        "twinkle_megatron_adamw_bf16_compiled": _full_megatron_adamw_bf16_compiled,
        "twinkle_megatron_distopt": _full_megatron,
        **{name: _fp8_row(*name.split("_", 2)[1:]) for name in FP8_ROWS},
    }
)
