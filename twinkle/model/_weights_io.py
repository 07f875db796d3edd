"""`TrainableModel`'s calls that write and read its weights, shared by both model classes.

Checkpoints (`save`, `load`, `resume_from_checkpoint`) and weight export (`get_state_dict`,
`weight_buckets`, `send_weights`). Each is a method of `TrainableModel`, bound in its class
body (``save = _weights_io.save``), so that it is defined once on the base with its
``remote_function`` policy, as the other shared calls are; ``self`` is the model. They reach
the model through what the base provides: ``_resolve``, ``_ensure_state``, ``_groups``,
``_check_supported`` and ``tokenizer_id``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

import twinkle_fn as tf
from twinkle.infra import remote_function
from twinkle.model import _checkpoint, _inputs
from twinkle_fn.export import DEFAULT_BUCKET_BYTES
from twinkle_fn.lora import PEFT_PREFIX

if TYPE_CHECKING:
    from twinkle.model._base import TrainableModel


@remote_function(execute="all", sync=True)
def save(
    self: TrainableModel,
    name: str | None = None,
    output_dir: str | os.PathLike[str] | None = None,
    interval: int = 1,
    save_optimizer: bool = False,
    consumed_train_samples: int = 0,
    adapter_name: str | None = None,
    merge_lora: bool = False,
) -> str | None:
    """Save to ``output_dir/name`` (default ``output/checkpoint-step-<steps>``) when the
    step count is a multiple of `interval`; returns the path (None when skipped).

    A full model is a `twinkle_fn.checkpoint` (HF weights, config and tokenizer, plus the
    optimizer state, step and `consumed_train_samples`, whatever `save_optimizer` says; on
    `MegatronModel` megatron's dist checkpoint, loadable on another tp / pp / dp mesh). An
    adapter is a peft directory (``adapter_config.json``, ``adapter_model.safetensors``,
    tokenizer), plus with `save_optimizer` a ``train_state/`` checkpoint to resume from.
    With `merge_lora`, an adapter is saved merged into the base weights instead: a plain HF
    model directory (upstream's ``save(..., merge_lora=True)``), plus its ``train_state/``
    with `save_optimizer`; without an adapter it changes nothing. Every rank must call
    it. Raises ``ValueError`` for an unknown adapter and an `interval` that is not a
    positive int (before anything is built or written).
    """
    _checkpoint.check_interval(interval)
    g = self._resolve(adapter_name)
    state = self._ensure_state(g)
    path = _checkpoint.save_path(state, name, output_dir, interval)
    if path is None:
        return None
    tokenizer = _inputs.tokenizer(g, self.tokenizer_id)
    write = _checkpoint.save_merged if merge_lora and g.name else _checkpoint.save
    write(state, path, g, tokenizer, save_optimizer, consumed_train_samples)
    return str(path)


@remote_function(execute="all", sync=True)
def load(
    self: TrainableModel,
    name: str | os.PathLike[str],
    output_dir: str | os.PathLike[str] | None = None,
    load_optimizer: bool = False,
    adapter_name: str | None = None,
) -> None:
    """Load what `save` wrote (``output_dir/name``, or `name` itself if it is a
    directory). Without `load_optimizer`: the weights alone (a full model's HF weights at
    the top of the directory, any HF checkpoint of this model; or the adapter's), keeping
    the optimizer state and step. With it: the whole training state (weights, optimizer,
    step). Every rank must call it. Raises ``ValueError`` for a missing or incompatible
    checkpoint, and for an adapter's weights alone where the class refuses loading them
    (`MegatronModel`, without `load_optimizer`).
    """
    g = self._resolve(adapter_name)
    if g.name and not load_optimizer:
        self._check_supported("adapter_load", f"load with adapter {g.name!r}")
    path = _checkpoint.checkpoint_dir(name, output_dir)
    state = self._ensure_state(g)
    others = [o.state for o in self._groups if o is not g and o.state is not None]
    g.state = _checkpoint.load(
        state, path, adapter_name=g.name, load_optimizer=load_optimizer, others=others
    )


@remote_function(execute="all", sync=True)
def resume_from_checkpoint(
    self: TrainableModel,
    checkpoint_dir: str | os.PathLike[str],
    *,
    resume_only_model: bool = False,
    adapter_name: str | None = None,
) -> dict[str, int]:
    """Restore a `save(save_optimizer=True)` checkpoint (a full one saved on any mesh):
    weights, and unless `resume_only_model` the optimizer state, step and schedule.
    Returns ``cur_step``, ``consumed_train_samples`` and ``gradient_accumulation_steps``
    as saved (feed the count to ``DataLoader.resume_from_checkpoint``). Raises as `load`
    does, and for a directory without a training state."""
    g = self._resolve(adapter_name)
    path = _checkpoint.checkpoint_dir(checkpoint_dir, None)
    self.load(path, load_optimizer=not resume_only_model, adapter_name=adapter_name)
    info = _checkpoint.resume_info(path, g.name)
    g.gradient_accumulation_steps = info["gradient_accumulation_steps"]
    return info


@remote_function(collect="first")
def get_state_dict(
    self: TrainableModel, adapter_name: str | None = None
) -> dict[str, torch.Tensor]:
    """What adapter `adapter_name` (default: the last added; the whole model without
    adapters) trains, as whole tensors: every weight by name, or the adapter's (keyed
    ``...lora_A.<adapter name>.weight`` on `TransformersModel`, as in a peft adapter file
    on `MegatronModel`). A collective on several ranks. Raises ``ValueError`` for an
    unknown adapter, listing the adapters there are."""
    return tf.unshard(self._ensure_state(self._resolve(adapter_name)))


def weight_buckets(
    self: TrainableModel,
    adapter_name: str | None = None,
    *,
    merge_and_sync: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The weights of adapter `adapter_name`'s group (default: the last added; the whole
    model without adapters) for a colocated rollout engine: `twinkle_fn.export_weights`'s
    stream of buckets of ``(hf_name, tensor)``, each fit for ``engine.load_weights(bucket)``.

    A collective: every rank iterates the whole stream. As upstream's ``merge_and_sync``:
    True yields every HF weight with the adapter merged in; False yields the adapter alone,
    keyed as in a peft adapter file (the engine keeps the base it loaded). Without adapters
    both yield every weight. In-process only (a generator does not cross a Ray actor).
    Raises ``ValueError`` for an unknown adapter and the arguments `export_weights`
    refuses."""
    state = self._ensure_state(self._resolve(adapter_name))
    lora = "merged" if merge_and_sync else "separate"
    return tf.export_weights(state, dtype=dtype, bucket_bytes=bucket_bytes, lora=lora)


@remote_function(dispatch="all")
def send_weights(
    self: TrainableModel,
    adapter_name: str | None = None,
    base_sync_done: bool = False,
    merge_and_sync: bool = False,
    *,
    engine: Any = None,
    dtype: torch.dtype = torch.bfloat16,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """Upstream's weight sync, into `engine`: an object with ``load_weights(iterable of
    (name, tensor))`` on this rank (a colocated vLLM / SGLang worker), called once per
    bucket of `weight_buckets` on every rank (a collective). Names are upstream's: HF
    names, and an adapter's peft names without ``base_model.model.``.

    `merge_and_sync` as `weight_buckets`. Upstream's first call of an adapter with
    ``merge_and_sync=False`` streams the frozen base; here the engine must have loaded that
    base from the checkpoint, so that call needs ``base_sync_done=True``.

    Raises ``ValueError`` without `engine` (upstream streams through its NCCL checkpoint
    engine between Ray actors, which twinkle has not), for `engine` without
    ``load_weights``, for the base sync above, and as `weight_buckets`."""
    if engine is None or not callable(getattr(engine, "load_weights", None)):
        raise ValueError(
            f"send_weights needs engine=<an object with load_weights(iterable of (name, "
            f"tensor))> on each rank, got engine={engine!r}: upstream's NCCL checkpoint "
            "engine (CheckpointEngineManager, Ray actors only) is not part of twinkle; "
            "feed a colocated engine, or iterate weight_buckets() yourself"
        )
    adapters = self._groups.adapter_names
    if adapters and not merge_and_sync and not base_sync_done:
        raise ValueError(
            f"send_weights(base_sync_done=False, merge_and_sync=False) on a model training "
            f"adapters {adapters}: the frozen base is not streamed; load the engine from "
            "the same checkpoint and pass base_sync_done=True, or merge_and_sync=True"
        )
    buckets = self.weight_buckets(
        adapter_name, merge_and_sync=merge_and_sync, dtype=dtype, bucket_bytes=bucket_bytes
    )
    for bucket in buckets:
        engine.load_weights([(name.removeprefix(PEFT_PREFIX), t) for name, t in bucket])
