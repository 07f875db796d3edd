"""State operations the class API needs and `twinkle_fn` does not offer yet.

Each is a small pure-ish function of a `TrainState` built from the core's own pieces; they are
candidates for the core (``tf.token_logps``, ``tf.grad_norm``, ``tf.checkpoint.load_weights``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file

from twinkle_fn import backends
from twinkle_fn.backends.fsdp import all_reduce_dp, copy_into_shard
from twinkle_fn.backends.hf import bind, model_inputs
from twinkle_fn.lora import PEFT_PREFIX, use_adapter
from twinkle_fn.losses import token_logps
from twinkle_fn.pytree import tree_global_norm
from twinkle_fn.state import Grads, TrainState


@torch.no_grad()
def forward_logps(
    state: TrainState,
    batch: Mapping[str, torch.Tensor],
    *,
    temperature: float = 1.0,
    return_logits: bool = False,
    disable_lora: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token ``log p(label)`` of `batch` under `state`, with no gradient.

    Runs the module's plain forward (its lm_head returns logits here), divides the logits by
    `temperature`, and takes `token_logps`. Returns ``(logps [B, T], logits [B, T, V] or
    None)``, logps 0 where the label is -100. With several LoRA adapters it computes with the
    state's; `disable_lora` computes with the base weights only (reference log-probs). On
    several ranks every rank must call it.
    """
    model = state.model
    use_adapter(state)
    bind(model.module, state.params, sharded=model.placement is not None)
    device = model.device
    autocast = (
        torch.autocast(device.type, dtype=model.compute_dtype)
        if model.compute_dtype != torch.float32
        else contextlib.nullcontext()
    )
    try:
        with autocast, _adapters_off(model.module) if disable_lora else contextlib.nullcontext():
            inputs = model_inputs(batch, device, model.config)
            logits = model.module(**inputs, use_cache=False).logits
    finally:
        backends.get(model.backend).after_eval(model)
    logits = logits / temperature  # [B, T, V]
    logps = token_logps(logits, batch["labels"].to(device))  # [B, T]
    return logps, (logits if return_logits else None)


def grad_norm(state: TrainState, grads: Grads, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the gradients `step` will apply: the token-sum gradients divided by every
    data rank's supervised tokens (what ``step``'s ``info["grad_norm"]`` reports). A collective
    on several ranks."""
    num_tokens = all_reduce_dp(grads.num_tokens, state.model.placement)
    return tree_global_norm(grads.params, norm_type) / num_tokens.clamp(min=1)


def adapter_key(adapter_name: str) -> Callable[[str], str]:
    """Maps a peft adapter file's key (``base_model.model.<path>.lora_A.weight``) to the
    module's parameter name (``<path>.lora_A.<adapter_name>.weight``)."""

    def rename(key: str) -> str:
        owner, _, leaf = key.removeprefix(PEFT_PREFIX).rpartition(".")
        return f"{owner}.{adapter_name}.{leaf}"

    return rename


def load_weights(
    params: Mapping[str, torch.Tensor],
    path: str | Path,
    rename: Callable[[str], str] = str,
) -> None:
    """Copy the tensors of the safetensors files in `path` into `params`, in place.

    Each saved key goes through `rename` to a parameter name; keys naming no parameter
    (frozen base weights, buffers) are skipped. Sharded parameters get their own slice (no
    communication). Raises ``ValueError`` when `path` has no safetensors file or lacks one of
    `params`, or a shape differs.
    """
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} holds no .safetensors weights")
    saved: dict[str, torch.Tensor] = {}
    for f in files:
        saved.update({rename(k): v for k, v in load_file(f).items()})
    missing = sorted(set(params) - set(saved))
    if missing:
        raise ValueError(f"{path} lacks {len(missing)} trainable parameters, e.g. {missing[:3]}")
    for name, p in params.items():
        if tuple(saved[name].shape) != tuple(p.shape):
            raise ValueError(
                f"{path}: {name} has shape {tuple(saved[name].shape)}, the model {tuple(p.shape)}"
            )
        copy_into_shard(p, saved[name].to(p.dtype))


@contextlib.contextmanager
def preserved(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Restore `tensors` (in place, shards included) to their values at entry when the block
    ends."""
    with torch.no_grad():
        saved = [t.detach().clone() for t in tensors]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, v in zip(tensors, saved, strict=True):
                t.copy_(v)


@contextlib.contextmanager
def _adapters_off(module: torch.nn.Module) -> Iterator[None]:
    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
