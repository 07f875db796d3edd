"""Checkpoints of `TransformersModel`: save, load, resume, and continuing an adapter.

A full model is a `twinkle_fn.checkpoint` (HF weights + config + tokenizer, plus optimizer
state and step). An adapter is a peft directory (`twinkle_fn.lora`), plus, when the optimizer is
saved, a ``train_state/`` checkpoint next to it to resume from.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from peft import LoraConfig

import twinkle_fn as tf
from twinkle.device_mesh import current_rank
from twinkle.model import _core_ops
from twinkle.model._group import Group

TRAIN_STATE_DIR = "train_state"  # next to a saved adapter: its optimizer state and step
RESUME_KEYS = ("cur_step", "consumed_train_samples", "gradient_accumulation_steps")


def save_path(
    state: tf.TrainState, name: str | None, output_dir: str | os.PathLike[str] | None, interval: int
) -> Path | None:
    """``output_dir/name`` (default ``output/checkpoint-step-<steps>``), or None when the step
    count is not a multiple of `interval`."""
    steps = int(state.step)
    if steps % interval:
        return None
    return Path(output_dir or "output") / (name or f"checkpoint-step-{steps}")


def save(
    state: tf.TrainState,
    path: Path,
    g: Group,
    tokenizer: Any,
    save_optimizer: bool,
    consumed_train_samples: int,
    save_adapter: Callable[[tf.TrainState, Path], Any] = tf.lora.save_adapter,
) -> None:
    """Write `state` to `path`: the full model (always with its optimizer state) when group `g`
    trains no adapter, else the adapter as a peft directory written by `save_adapter` (the
    megatron backend's is `twinkle_fn.megatron.lora.save_adapter`), with its optimizer state
    when `save_optimizer`. The training state also records the step,
    `consumed_train_samples` and the group's accumulation steps (`resume_info`). Every rank
    must call it."""
    extra = {
        "cur_step": int(state.step),
        "consumed_train_samples": consumed_train_samples,
        "gradient_accumulation_steps": g.gradient_accumulation_steps,
    }
    if not g.name:
        tf.checkpoint.save(state, path, tokenizer=tokenizer, extra=extra)
        return
    save_adapter(state, path)
    if save_optimizer:
        tf.checkpoint.save(state, path / TRAIN_STATE_DIR, extra=extra)
    if tokenizer is not None and current_rank() == 0:
        tokenizer.save_pretrained(path)


def checkpoint_dir(name: str | os.PathLike[str], output_dir: Any) -> Path:
    """``output_dir/name``; without `output_dir`, `name` itself, else ``output/name``.
    Raises ``ValueError`` when that directory does not exist."""
    path = Path(name) if output_dir is None else Path(output_dir) / name
    if output_dir is None and not path.is_dir():
        path = Path("output") / name
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
        with _core_ops.preserved([p for o in others for p in o.params.values()]):
            return tf.checkpoint.load(state, path / TRAIN_STATE_DIR if adapter_name else path)
    rename = _core_ops.adapter_key(adapter_name) if adapter_name else str
    _core_ops.load_weights(state.params, path, rename)
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
    _core_ops.load_weights(trainable, path, _core_ops.adapter_key(adapter_name))
    return model


def _adapter_dir(path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    if not (path / "adapter_config.json").is_file():
        raise ValueError(
            f"{path} is not a peft adapter directory (no adapter_config.json); pass a "
            "LoraConfig or a directory written by save()"
        )
    return path
