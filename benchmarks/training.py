"""The training steps the benchmarks time, built alike: the run's `Setup`, the optimizer settings
(AdamW, lr 1e-5, weight decay 0.01, clipping at 1.0), the batches as a data loader hands them
over, twinkle's step and the plain transformers loop, and a one-rank world for megatron-core."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

import twinkle_fn as tf
from benchmarks.timing import Step
from twinkle_fn.data import IGNORE_INDEX
from twinkle_fn.mesh import Mesh

LR, WEIGHT_DECAY, CLIP = 1e-5, 0.01, 1.0


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every row trains: the HF config, the token batch and the run's options."""

    config: PretrainedConfig
    input_ids: torch.Tensor  # [batch, seq] random tokens on the device
    device: torch.device
    compile_scope: str
    profile: bool = False  # also profile two steps per row (`benchmarks.profile_summary`)


def twinkle_optimizer(backend: str, lr: Any = LR) -> tf.optim.GradientTransformation:
    """AdamW with clipping at learning rate `lr` (a float or a schedule): the optax-style chain,
    or on the megatron backend the transform its docs name for it (megatron-core's distributed
    optimizer, as in the ``mcore_*`` rows)."""
    if backend == "megatron":
        from twinkle_fn.optim import megatron_optimizer

        return megatron_optimizer(lr, weight_decay=WEIGHT_DECAY, clip_grad=CLIP)
    return tf.optim.chain(
        tf.optim.clip_by_global_norm(CLIP), tf.optim.adamw(lr, weight_decay=WEIGHT_DECAY)
    )


def train_step(state: tf.TrainState, batches: Sequence[dict[str, Any]]) -> Step:
    """``tf.fwd_bwd`` + ``tf.step`` of `state`, on each of `batches` in turn (round robin)."""
    holder, count = [state], [0]

    def step() -> torch.Tensor:
        batch = batches[count[0] % len(batches)]
        count[0] += 1
        grads, _ = tf.fwd_bwd(holder[0], batch)
        holder[0], info = tf.step(holder[0], grads)
        return info["loss"]

    return step


def twinkle_step(
    setup: Setup,
    backend: str,
    options: dict[str, Any] | None = None,
    *,
    tx: tf.optim.GradientTransformation | None = None,
    activation_checkpointing: bool = False,
    lora: dict[str, Any] | None = None,
    batches: Sequence[dict[str, Any]] = (),
    init_on_device: bool = True,
) -> Step:
    """``tf.fwd_bwd`` + ``tf.step`` on `backend` with `tx` (default `twinkle_optimizer`), bf16
    compute; `lora` (``LoraConfig`` fields) trains an adapter. The step trains on each of
    `batches` in turn, handed over from the host (`host_batch`; default: the padded full rows
    of ``setup.input_ids``). With `init_on_device` the HF module is built, and its random init
    drawn, on the device, else on the host and then moved."""
    # The megatron backend builds its own model and reads the HF module's weights once: the
    # module stays on the CPU (the model's default there), or its float32 copy of every weight
    # (4 bytes a parameter) would sit on the GPU through the row, counted in its peak.
    place = torch.device("cpu") if backend == "megatron" else setup.device
    with torch.device(place) if init_on_device else contextlib.nullcontext():
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
    state = tf.init(model, twinkle_optimizer(backend) if tx is None else tx)
    batches = batches or (padded_batch(setup.input_ids.cpu()),)
    return train_step(state, [host_batch(b, setup.device) for b in batches])


def hf_model(setup: Setup, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The HF model of ``setup.config`` with SDPA attention, in training mode: `dtype`
    parameters, built (and randomly initialised from seed 0) on the device."""
    torch.manual_seed(0)
    with torch.device(setup.device):
        return AutoModelForCausalLM.from_config(
            setup.config, dtype=dtype, attn_implementation="sdpa"
        ).train()


def hf_step(setup: Setup, compile_scope: str | None, **inputs: Any) -> Step:
    """A plain transformers loop (`hf_loop_step`, its `inputs`) of a float32 `hf_model`;
    `compile_scope` ``"model"`` compiles the whole model, ``"layer"`` each decoder layer, None
    nothing."""
    model = hf_model(setup)
    params = list(model.parameters())
    if compile_scope == "layer":
        for layer in model.model.layers:
            layer.compile(dynamic=False)
    forward = torch.compile(model, dynamic=False) if compile_scope == "model" else model
    return hf_loop_step(forward, params, setup, **inputs)


def hf_loop_step(
    forward: Callable[..., Any], params: list[torch.nn.Parameter], setup: Setup, **inputs: Any
) -> Step:
    """The step users write around a transformers model `forward` (maybe compiled): bf16
    autocast, ``forward(**inputs).loss``, ``clip_grad_norm_`` and fused AdamW over `params`.
    `inputs` default to ``setup.input_ids`` as the inputs and the labels, without a cache."""
    device, ids = setup.device, setup.input_ids
    inputs = inputs or {"input_ids": ids, "labels": ids, "use_cache": False}
    fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, **fused)

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = forward(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


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


def host_batch(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
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

    On a CPU `twinkle_fn.backends.megatron.parallel.initialize` enables `cpu_compat`; both are
    undone on exit, as is a process group this made.
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


def backend_world(backend: str, device: torch.device) -> contextlib.AbstractContextManager[None]:
    """The world `backend` needs on `device`: `megatron_world` for megatron, else nothing."""
    return megatron_world(device) if backend == "megatron" else contextlib.nullcontext()
