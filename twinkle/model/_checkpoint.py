"""Checkpoints of the model classes: save, load, resume, and continuing an adapter.

A full model is a `twinkle_fn.checkpoint` (HF weights + config + tokenizer, plus optimizer
state and step). An adapter is a peft directory (`twinkle_fn.lora`), plus, when the optimizer
is saved, a ``train_state/`` checkpoint next to it to resume from.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig
from safetensors.torch import save_file

import twinkle_fn as tf
from twinkle.device_mesh import current_rank
from twinkle.model._group import Group

TRAIN_STATE_DIR = "train_state"  # next to a saved adapter: its optimizer state and step
SAFE_INDEX = "model.safetensors.index.json"  # transformers' name for a sharded model's index
RESUME_KEYS = ("cur_step", "consumed_train_samples", "gradient_accumulation_steps")


def save_path(
    state: tf.TrainState, name: str | None, output_dir: str | os.PathLike[str] | None, interval: int
) -> Path | None:
    """``output_dir/name`` (default ``output/checkpoint-step-<steps>``), or None when the step
    count is not a multiple of `interval` (a positive int: `check_interval`)."""
    steps = int(state.step)
    if steps % interval:
        return None
    return Path(output_dir or "output") / (name or f"checkpoint-step-{steps}")


def check_interval(interval: Any) -> None:
    """Raises ``ValueError`` unless `interval` (save every `interval` steps) is a positive int."""
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ValueError(
            f"save(interval={interval!r}): interval must be a positive int (save when the step "
            "count is a multiple of it); pass interval=1 to save on every call"
        )


def save(
    state: tf.TrainState,
    path: Path,
    g: Group,
    tokenizer: Any,
    save_optimizer: bool,
    consumed_train_samples: int,
) -> None:
    """Write `state` to `path`: the full model (always with its optimizer state) when group `g`
    trains no adapter, else the adapter as a peft directory (`twinkle_fn.lora.save_adapter`),
    with its optimizer state in ``train_state/`` when `save_optimizer`. The training state also
    records the step, `consumed_train_samples` and the group's accumulation steps
    (`resume_info`). Every part is written into one staged directory that replaces `path` in a
    single atomic switch, so an interrupted save leaves the previous save whole. Every rank
    must call it."""
    extra = {
        "cur_step": int(state.step),
        "consumed_train_samples": consumed_train_samples,
        "gradient_accumulation_steps": g.gradient_accumulation_steps,
    }
    with tf.checkpoint.staged(path) as directory:
        if not g.name:
            tf.checkpoint.save_into(state, directory, tokenizer=tokenizer, extra=extra)
            return
        tf.lora.save_adapter_into(state, directory)
        if save_optimizer:
            tf.checkpoint.save_into(state, directory / TRAIN_STATE_DIR, extra=extra)
        if tokenizer is not None and current_rank() == 0:
            tokenizer.save_pretrained(directory)


def save_merged(
    state: tf.TrainState,
    path: Path,
    g: Group,
    tokenizer: Any,
    save_optimizer: bool,
    consumed_train_samples: int,
) -> None:
    """Write `state`'s model with group `g`'s adapter merged into its weights (``W + scaling *
    B @ A``, in the parameters' dtype) as an HF model directory at `path` (``config.json``,
    safetensors shards, one per exported bucket, with their index; the tokenizer), which ``from_pretrained`` loads as a
    plain model; with `save_optimizer` also the adapter's ``train_state/`` (as `save`). One
    atomic switch, as `save`. Every rank must call it (the weights are gathered)."""
    config = state.model.config
    dtype = next(iter(state.params.values())).dtype  # the model's (the adapters share it)
    with tf.checkpoint.staged(path) as directory:
        weight_map: dict[str, str] = {}
        buckets = tf.export_weights(state, dtype=dtype, lora="merged")
        for i, bucket in enumerate(buckets):
            file = f"model-{i + 1:05d}.safetensors"
            if current_rank() == 0:
                tensors = {name: t.detach().cpu().contiguous() for name, t in bucket}
                save_file(tensors, directory / file, metadata={"format": "pt"})
            weight_map.update((name, file) for name, _ in bucket)
        if current_rank() == 0:
            config.save_pretrained(directory)
            index = {"metadata": {}, "weight_map": weight_map}
            (directory / SAFE_INDEX).write_text(json.dumps(index, indent=2))
            if tokenizer is not None:
                tokenizer.save_pretrained(directory)
        if save_optimizer:
            extra = {
                "cur_step": int(state.step),
                "consumed_train_samples": consumed_train_samples,
                "gradient_accumulation_steps": g.gradient_accumulation_steps,
            }
            tf.checkpoint.save_into(state, directory / TRAIN_STATE_DIR, extra=extra)


def checkpoint_dir(name: str | os.PathLike[str], output_dir: Any) -> Path:
    """``output_dir/name``; without `output_dir`, `name` itself, else ``output/name``.
    Raises ``ValueError`` when that directory does not exist."""
    path = tf.checkpoint.current(Path(name) if output_dir is None else Path(output_dir) / name)
    if output_dir is None and not path.is_dir():
        path = tf.checkpoint.current(Path("output") / name)
    if not path.is_dir():
        raise ValueError(f"checkpoint directory {path} does not exist")
    return path


def load(
    state: tf.TrainState,
    path: Path,
    *,
    adapter_name: str,
    load_optimizer: bool,
    others: Iterable[tf.TrainState] = (),
) -> tf.TrainState:
    """`state` with the trainable weights saved in `path` (copied in place), or with
    `load_optimizer` the whole saved training state. `others`: the other adapters' states on
    the same module, left as they are. Raises ``ValueError`` for a missing or incompatible
    checkpoint."""
    if load_optimizer:
        # The training state holds every module tensor at save time, the other adapters'
        # included, and tf.checkpoint.load writes them all back: keep theirs current.
        with _preserved([p for o in others for p in o.params.values()]):
            return tf.checkpoint.load(state, path / TRAIN_STATE_DIR if adapter_name else path)
    rename = adapter_key(adapter_name) if adapter_name else None
    tf.checkpoint.load_weights(state, path, rename)
    return state


def resume_info(path: Path, adapter_name: str) -> dict[str, int]:
    """``cur_step``, ``consumed_train_samples`` and ``gradient_accumulation_steps`` as saved
    in `path`. Raises ``ValueError`` when it holds no training state."""
    train_state = path / TRAIN_STATE_DIR if adapter_name else path
    if not tf.checkpoint.is_complete(train_state):
        raise ValueError(f"{path} has no training state; save it with save_optimizer=True")
    extra = tf.checkpoint.read_extra(train_state)
    return {key: extra[key] for key in RESUME_KEYS}


def add_adapter(
    model: tf.models.Model,
    adapter_name: str,
    config_or_dir: LoraConfig | Mapping[str, Any] | str | os.PathLike[str],
) -> tf.models.Model:
    """`model` with LoRA adapter `adapter_name` from a config, or from a peft adapter directory
    (its config and weights). Raises ``ValueError`` for a directory that is not an adapter's,
    and for what `twinkle_fn.lora.add_lora` rejects."""
    if not isinstance(config_or_dir, str | os.PathLike):
        return tf.lora.add_lora(model, config_or_dir, adapter_name)
    path = _adapter_dir(config_or_dir)
    config = LoraConfig.from_pretrained(path)
    config.inference_mode = False
    model = tf.lora.add_lora(model, config, adapter_name)
    trainable = {n: p for n, p in model.module.named_parameters() if p.requires_grad}
    _copy_weights(trainable, path, adapter_key(adapter_name))
    return model


def adapter_key(adapter_name: str) -> Callable[[str], str]:
    """Maps a peft adapter file's key (``base_model.model.<path>.lora_A.weight``) to the
    module's parameter name (``<path>.lora_A.<adapter_name>.weight``)."""

    def rename(key: str) -> str:
        owner, _, leaf = key.removeprefix(tf.lora.PEFT_PREFIX).rpartition(".")
        return f"{owner}.{adapter_name}.{leaf}"

    return rename


@torch.no_grad()
def _copy_weights(
    params: Mapping[str, torch.Tensor], path: Path, rename: Callable[[str], str]
) -> None:
    """Copy the adapter file's tensors into the (not yet placed) `params`, in place. Raises
    ``ValueError`` when the file lacks one of them or a shape differs."""
    saved = tf.checkpoint.read_weights(path, rename)
    missing = sorted(set(params) - set(saved))
    if missing:
        raise ValueError(f"{path} lacks {len(missing)} trainable parameters, e.g. {missing[:3]}")
    for name, p in params.items():
        if tuple(saved[name].shape) != tuple(p.shape):
            raise ValueError(
                f"{path}: {name} has shape {tuple(saved[name].shape)}, the model {tuple(p.shape)}"
            )
        p.copy_(saved[name])


@contextlib.contextmanager
def _preserved(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
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


def _adapter_dir(path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    if not (path / "adapter_config.json").is_file():
        raise ValueError(
            f"{path} is not a peft adapter directory (no adapter_config.json); pass a "
            "LoraConfig or a directory written by save()"
        )
    return path
