"""`MegatronModel`: upstream Twinkle's Megatron class over the core's megatron backend.

The object holds a `TrainState` of a ``backend="megatron"`` model (built lazily, so the optimizer
and scheduler are set first) and the pending `Grads` (views of megatron's DDP grad buffers):

- ``forward_backward`` = ``tf.fwd_bwd(state, batch, accum=pending)`` (megatron's schedule runs
  forward and backward together);
- ``clip_grad_and_step`` = ``tf.step(state, pending)`` once exactly N calls are pending
  (N = ``gradient_accumulation_steps``), so the update is normalised over all their tokens.
  Upstream steps one micro-batch late; this does not.

The optimizer is always megatron-core's distributed Adam (`megatron_optimizer`) and the lr
follows ``OptimizerParamScheduler`` (`twinkle_fn.schedules.megatron`), as upstream allows.

- ``add_adapter_to_model`` = `twinkle_fn.lora.add_lora` before the state is built: one
  LoRA adapter per model (the core's megatron LoRA trains one), which names the single group;
- ``save``/``load`` = `twinkle_fn.checkpoint` (full model: megatron's dist checkpoint of model,
  optimizer, step and RNG, loadable on another tp/pp/dp mesh, plus HF safetensors) or, with an
  adapter, `twinkle_fn.lora.save_adapter` (a peft directory). A weights-only ``load``
  copies the directory's HF weights into the model through the bridge and refreshes the
  optimizer's fp32 main parameters from them.

Not wired: ``forward``/``calculate_loss``/``backward`` (upstream raises too); continuing an
adapter from a peft directory, loading an adapter, and training states of adapters
(``save_optimizer=True``): the core's megatron backend does not read adapters back nor
dist-checkpoint LoRA states yet.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from peft import LoraConfig
from transformers import AutoConfig, PretrainedConfig

import twinkle_fn as tf
from twinkle.data_format import ModelOutput
from twinkle.device_mesh import DeviceMesh
from twinkle.infra import remote_class, remote_function, settings
from twinkle.model import _accumulate, _build, _checkpoint, _group, _inputs, optim
from twinkle.processor import InputProcessor, unpack
from twinkle_fn.models.model import resolve_model_dir

OPTIMIZERS = ("default", "MegatronDistributedOptimizer")
SCHEDULERS = ("default", "OptimizerParamScheduler")
DEFAULT_LR = 1e-4  # upstream's OptimizerConfig default
# Upstream's set_optimizer names (megatron's OptimizerConfig) -> `megatron_optimizer`'s.
_OPTIMIZER_ARGS = {
    "weight_decay": "weight_decay",
    "adam_beta1": "b1",
    "adam_beta2": "b2",
    "adam_eps": "eps",
    "clip_grad": "clip_grad",
    "loss_scale": "loss_scale",
    "initial_loss_scale": "initial_loss_scale",
}
# What the core's DDP does (upstream's defaults); other values are refused. overlap_grad_reduce
# and overlap_param_gather are the core's options of those names (either value).
_CORE_OPTIONS = ("overlap_grad_reduce", "overlap_param_gather")
_DDP_CONFIG = {
    "grad_reduce_in_fp32": True,
    "use_distributed_optimizer": True,
}
_PRECISIONS = ("no", "bf16", "fp16")


def optimizer_spec(optimizer_cls: Any, **kwargs: Any) -> optim.OptimizerSpec:
    """Megatron's distributed Adam with upstream's ``OptimizerConfig`` arguments (``lr``
    default 1e-4, ``weight_decay``, ``adam_beta1``/``adam_beta2``/``adam_eps``, ``clip_grad``
    default 1.0, ``loss_scale``, ``initial_loss_scale``).

    Raises ``ValueError`` for an optimizer other than 'default' / 'MegatronDistributedOptimizer'
    or an out-of-range value, ``TypeError`` for an unknown argument.
    """
    name = optim._name(optimizer_cls)
    if name not in OPTIMIZERS:
        raise ValueError(
            f"MegatronModel does not support optimizer {optimizer_cls!r}: megatron trains with "
            f"its distributed optimizer only; pass one of {', '.join(map(repr, OPTIMIZERS))}"
        )
    lr = kwargs.pop("lr", DEFAULT_LR)
    unknown = sorted(set(kwargs) - set(_OPTIMIZER_ARGS))
    if unknown:
        raise TypeError(
            f"set_optimizer arguments {unknown} are not supported; known: lr, "
            f"{', '.join(_OPTIMIZER_ARGS)}"
        )
    spec = optim.OptimizerSpec(
        OPTIMIZERS[1], lr, {_OPTIMIZER_ARGS[k]: v for k, v in kwargs.items()}
    )
    tf.optim.megatron_optimizer(lr, **spec.kwargs)  # check the values now, not at the first step
    return spec


def _check_options(mixed_precision: str, ddp_config: Mapping[str, Any] | None) -> None:
    if mixed_precision not in _PRECISIONS:
        raise ValueError(
            f"mixed_precision must be one of {', '.join(_PRECISIONS)}, got {mixed_precision!r}"
        )
    for key, value in (ddp_config or {}).items():
        if key in _CORE_OPTIONS and isinstance(value, bool):
            continue
        if _DDP_CONFIG.get(key, object()) != value:
            raise ValueError(
                f"ddp_config {key}={value!r} is not supported: the core's megatron DDP runs "
                f"with {_DDP_CONFIG}"
            )


def _recompute(granularity: str | None, method: str | None, num_layers: int | None) -> dict:
    """Megatron's recompute fields: none without a granularity, only it for 'selective'."""
    if granularity is None:
        return {}
    if granularity == "selective":
        return {"recompute_granularity": granularity}
    return dict(
        recompute_granularity=granularity,
        recompute_method=method,
        recompute_num_layers=num_layers,
    )


@remote_class(execute="all")
class MegatronModel:
    """A causal LM trained by megatron-core through `twinkle_fn`, with upstream's methods.

    `model_id`: a local HF directory or ``hf://``/``ms://`` id; each rank reads its slices of
    the safetensors (``load_weights=False``: a random init of its config). Without `model_id`,
    `config` (an HF config) builds a random init. `device_mesh` (default: the `initialize`
    mesh, else dp over the world) gives tp / pp / cp / ep / sequence_parallel; it must match
    the world. `mixed_precision`: ``'no'`` (fp32), ``'bf16'`` or ``'fp16'`` over fp32 master
    weights. `ddp_config`: ``overlap_grad_reduce`` (reduce gradients during backward; default on,
    unlike upstream: the result is the same up to summation order), ``overlap_param_gather``
    (gather the distributed optimizer's parameters during the next forward; default off),
    otherwise only upstream's defaults (fp32 grad reduce, distributed optimizer). `recompute_*`: megatron's activation recompute (granularity None: off).
    `param_offload` / `grad_offload` / `optimizer_offload`: after each optimizer step, park the
    parameters / megatron's gradient buffers / the optimizer's tensors in host memory until the
    next call that needs them (`twinkle_fn.offload`; for sharing the GPU with a rollout engine). Other
    keyword arguments: ``tokenizer_id``, ``seed`` (init and dropout; default the `initialize`
    seed), ``num_micro_batches`` (pipeline micro-batches per call; default pp size), and any
    megatron ``TransformerConfig`` field. Raises ``ValueError`` for unsupported options, a mesh
    that does not match the world, or no model source.
    """

    def __init__(
        self,
        model_id: str | os.PathLike[str] | None = None,
        config: PretrainedConfig | None = None,
        ddp_config: Mapping[str, Any] | None = None,
        device_mesh: DeviceMesh | None = None,
        mixed_precision: str = "bf16",
        load_weights: bool = True,
        recompute_granularity: str | None = "full",
        recompute_method: str | None = "uniform",
        recompute_num_layers: int | None = 1,
        param_offload: bool = False,
        grad_offload: bool = False,
        optimizer_offload: bool = False,
        **kwargs: Any,
    ) -> None:
        _check_options(mixed_precision, ddp_config)
        self.device_mesh = _build.device_mesh(device_mesh)
        self.mixed_precision = mixed_precision
        self.model_id = None if model_id is None else os.fspath(model_id)
        self.tokenizer_id = kwargs.pop("tokenizer_id", self.model_id)
        self._seed = kwargs.pop("seed", settings().seed)
        if model_id is not None and not load_weights:
            model_id, config = None, AutoConfig.from_pretrained(resolve_model_dir(model_id))
        if model_id is None and config is None:
            raise ValueError("MegatronModel needs model_id=<dir or hub id> or config=")
        options = {**_recompute(recompute_granularity, recompute_method, recompute_num_layers)}
        options.update({k: v for k, v in (ddp_config or {}).items() if k in _CORE_OPTIONS})
        options.update(kwargs)
        self._model = _build.build_model(
            model_id,
            None if model_id is not None else config,
            {},
            mixed_precision,
            {},
            self._seed,
            backend="megatron",
            options=options,
        )
        self._group = _group.Group(
            optimizer=optimizer_spec("default"), processor=InputProcessor(self.device_mesh)
        )
        self._state: tf.TrainState | None = None
        self._offload = dict(params=param_offload, grads=grad_offload, optimizer=optimizer_offload)
        self._parked: tf.Offloaded | None = None
        self._pending = _accumulate.Pending()

    @property
    def state(self) -> tf.TrainState:
        """The current `twinkle_fn.TrainState` (built on first access; a collective)."""
        return self._ensure_state()

    def _ensure_state(self) -> tf.TrainState:
        if self._parked is not None:
            self._state, self._parked = tf.reload(self._parked), None
        if self._state is None:
            g = self._group
            tx = tf.optim.megatron_optimizer(_group.learning_rate(g), **g.optimizer.kwargs)
            self._state = tf.init(self._model, tx, self.device_mesh.mesh, seed=self._seed)
        return self._state

    def _check_unbuilt(self, what: str) -> None:
        if self._state is not None or self._parked is not None:
            raise ValueError(
                f"{what} must be called before the first forward_backward: megatron's "
                "distributed optimizer is built with the train state"
            )

    # Training calls.
    @remote_function(dispatch="slice_dp", collect="mean", sync=True)
    def forward_backward(
        self,
        *,
        inputs: Any,
        micro_batch_size: int | None = None,
        adapter_name: str | None = None,
    ) -> ModelOutput:
        """Forward and backward on this rank's `inputs` (megatron's schedule), adding the
        gradients to the pending ones. Counts as one micro-batch of gradient accumulation.

        `inputs`: feature dicts (``input_ids``, already-shifted ``labels``), chat trajectories
        or a collated batch. `micro_batch_size`: rows per megatron run (default: the whole
        list at once, split into ``num_micro_batches`` pipeline micro-batches). Returns
        ``loss`` (token mean on this rank, a float), ``num_tokens`` and ``logps``
        (``[n_seq, max_len]`` per-token ``log p(label)`` of this rank's samples, 0 where the
        label is -100, as `TransformersModel` returns them; from the training forward itself,
        the same on every pipeline stage). Raises ``TypeError`` for a `micro_batch_size` with
        a collated batch, ``ValueError`` for a non-positive one.
        """
        g = _group.resolve(self._group, adapter_name)
        state = self._ensure_state()
        runs = []
        for i, chunk in enumerate(_chunks(inputs, micro_batch_size)):
            batch = _inputs.encode(g, self.tokenizer_id, chunk)
            runs.append((batch, self._pending.add(state, batch, counts=i == 0)))
        # The runs' sums add up on the device; the call's numbers are read once, here.
        totals = _accumulate.read_loss(
            sum(aux["loss_sum"] for _, aux in runs), sum(aux["num_tokens"] for _, aux in runs)
        )
        logps = _stack_rows([unpack(aux["logps"], batch) for batch, aux in runs])
        return ModelOutput(logps=logps, **totals)

    @remote_function(dispatch="slice_dp", collect="mean")
    def forward_only(self, *, inputs: Any, adapter_name: str | None = None) -> ModelOutput:
        """An evaluation forward (no gradient): this rank's token-mean ``loss``,
        ``num_tokens`` and ``logps`` (``[n_seq, max_len]``, as `forward_backward`), the same
        on every pipeline stage."""
        g = _group.resolve(self._group, adapter_name)
        batch = _inputs.encode(g, self.tokenizer_id, inputs)
        got = tf.token_logps(self._ensure_state(), batch)
        return ModelOutput(
            logps=unpack(got["logps"], batch),
            **_accumulate.read_loss(got["loss_sum"], got["num_tokens"]),
        )

    def forward(self, **kwargs: Any) -> None:
        """Not available: raises ``TypeError`` (megatron runs forward and backward together)."""
        raise TypeError(_TOGETHER.format("forward"))

    def calculate_loss(self, **kwargs: Any) -> None:
        """Not available: raises ``TypeError`` (the loss is computed inside forward_backward)."""
        raise TypeError(_TOGETHER.format("calculate_loss"))

    def backward(self, **kwargs: Any) -> None:
        """Not available: raises ``TypeError`` (megatron runs forward and backward together)."""
        raise TypeError(_TOGETHER.format("backward"))

    def _due(self, adapter_name: str | None, gradient_accumulation_steps: int | None) -> bool:
        g = _group.resolve(self._group, adapter_name)
        return self._pending.due(_group.accumulation_steps(g, gradient_accumulation_steps))

    def _check_clip(self, max_grad_norm: float, norm_type: float) -> None:
        clip = self._group.optimizer.kwargs.get("clip_grad", 1.0)
        if max_grad_norm != clip or norm_type != 2:
            raise ValueError(
                f"max_grad_norm={max_grad_norm}, norm_type={norm_type}: megatron's optimizer "
                f"clips by the L2 norm to its clip_grad={clip}; set it with "
                "set_optimizer('default', clip_grad=...)"
            )

    def _apply(self) -> float:
        """One update from the pending gradients; parks the state if offloading is on."""
        self._state = self._pending.apply(self._ensure_state())
        if any(self._offload.values()):
            self._parked, self._state = tf.offload(self._state, **self._offload), None
        return float(self._pending.last_step["grad_norm"])

    @remote_function(dispatch="all", sync=True)
    def clip_grad_and_step(
        self,
        max_grad_norm: float = 1.0,
        norm_type: float = 2,
        adapter_name: str | None = None,
        gradient_accumulation_steps: int | None = None,
    ) -> float | None:
        """After exactly `gradient_accumulation_steps` forward_backward calls (default: the
        group's): one update of megatron's optimizer (it clips to its ``clip_grad``) and the
        schedule; returns the global gradient norm before clipping, else None.

        Raises ``ValueError`` when `max_grad_norm` differs from the optimizer's ``clip_grad``
        (set it with ``set_optimizer(clip_grad=...)``) or `norm_type` is not 2.
        """
        self._check_clip(max_grad_norm, norm_type)
        if not self._due(adapter_name, gradient_accumulation_steps):
            return None
        return self._apply()

    @remote_function(sync=True)
    def clip_grad_norm(
        self,
        max_grad_norm: float = 1.0,
        norm_type: float = 2,
        adapter_name: str | None = None,
        gradient_accumulation_steps: int | None = None,
    ) -> float | None:
        """On a step boundary: the global gradient norm before clipping; None while
        micro-batches are still accumulating.

        megatron's distributed optimizer reduces, measures and clips the gradients inside its
        update, so this call makes the update (as `clip_grad_and_step`); the `step`,
        `zero_grad` and `lr_step` of upstream's four-call loop then find nothing pending.
        Raises ``ValueError`` as `clip_grad_and_step` does.
        """
        return self.clip_grad_and_step(
            max_grad_norm, norm_type, adapter_name, gradient_accumulation_steps
        )

    @remote_function(sync=True)
    def step(
        self,
        adapter_name: str | None = None,
        gradient_accumulation_steps: int | None = None,
        **kwargs: Any,
    ) -> None:
        """On a step boundary with gradients pending (no `clip_grad_norm` made the update
        yet): one update of megatron's optimizer, clipping to its ``clip_grad``. Raises
        ``ValueError`` for options (set them with `set_optimizer`)."""
        if kwargs:
            raise ValueError(
                f"step() options {sorted(kwargs)} are not supported; call set_optimizer(...) "
                "to change the learning rate or weight decay"
            )
        if self._due(adapter_name, gradient_accumulation_steps):
            self._apply()

    @remote_function()
    def zero_grad(
        self,
        adapter_name: str | None = None,
        gradient_accumulation_steps: int | None = None,
        set_to_none: bool = True,
    ) -> None:
        """Nothing to do: the update consumed the pending gradients (megatron zeroes its grad
        buffers when the next forward_backward starts)."""
        _group.resolve(self._group, adapter_name)

    @remote_function()
    def lr_step(
        self, adapter_name: str | None = None, gradient_accumulation_steps: int | None = None
    ) -> None:
        """Nothing to do: the lr follows ``OptimizerParamScheduler`` as a function of the
        update count, so each update already moves it on."""
        _group.resolve(self._group, adapter_name)

    @remote_function(collect="first")
    def calculate_metric(self, is_training: bool = True, adapter_name: str | None = None) -> dict:
        """The last step's ``loss`` (token mean over its calls and data ranks), ``grad_norm``,
        ``lr``, ``num_tokens`` and ``step``."""
        _group.resolve(self._group, adapter_name)
        return self._pending.metrics()

    # Settings.
    @remote_function()
    def set_optimizer(self, optimizer_cls: Any, **kwargs: Any) -> None:
        """Use megatron's distributed optimizer ('default' / 'MegatronDistributedOptimizer')
        with upstream's arguments (see `optimizer_spec`). Raises ``ValueError`` for any other
        optimizer, naming the accepted ones, and after the first forward_backward."""
        g = _group.resolve(self._group, kwargs.pop("adapter_name", None))
        spec = optimizer_spec(optimizer_cls, **kwargs)
        self._check_unbuilt("set_optimizer")
        g.optimizer = spec

    @remote_function()
    def set_lr_scheduler(self, scheduler_cls: Any, **kwargs: Any) -> None:
        """Schedule the lr as megatron's ``OptimizerParamScheduler`` ('default' /
        'OptimizerParamScheduler'; ``lr_decay_steps``, ``lr_warmup_steps``, ``lr_decay_style``,
        ``max_lr`` (default the optimizer's lr), ``min_lr``, ...), counted in optimizer steps.
        Raises ``ValueError`` for any other scheduler, naming the accepted ones, for values
        megatron rejects, and after the first forward_backward."""
        g = _group.resolve(self._group, kwargs.pop("adapter_name", None))
        if optim._name(scheduler_cls) not in SCHEDULERS:
            raise ValueError(
                f"MegatronModel does not support lr scheduler {scheduler_cls!r}: megatron "
                f"schedules with OptimizerParamScheduler only; pass one of "
                f"{', '.join(map(repr, SCHEDULERS))}"
            )
        self._check_unbuilt("set_lr_scheduler")
        _group.set_scheduler(g, scheduler_cls, kwargs)

    @remote_function()
    def set_template(self, template_cls: Any = "Template", **kwargs: Any) -> None:
        """Encode chat trajectories with a `Template` (as `TransformersModel.set_template`)."""
        g = _group.resolve(self._group, kwargs.pop("adapter_name", None))
        g.template = _inputs.make_group_template(template_cls, self.tokenizer_id, kwargs)

    @remote_function()
    def set_processor(self, processor_cls: Any = "InputProcessor", **kwargs: Any) -> None:
        """Collate with an `InputProcessor` (as `TransformersModel.set_processor`)."""
        g = _group.resolve(self._group, kwargs.pop("adapter_name", None))
        g.processor = _inputs.make_processor(processor_cls, self.device_mesh, kwargs)

    # Adapters and checkpoints.
    @remote_function(execute="all", sync=True)
    def add_adapter_to_model(
        self,
        adapter_name: str,
        config_or_dir: LoraConfig | Mapping[str, Any] | str | os.PathLike[str],
        is_trainable: bool = True,
        gradient_accumulation_steps: int = 1,
    ) -> None:
        """Train LoRA adapter `adapter_name` (a ``LoraConfig`` or a dict of its fields; see
        `twinkle_fn.backends.megatron.lora` for the targets) instead of the full model: the model's one
        group takes that name and `gradient_accumulation_steps`, keeping the settings made
        before. Call it before the first forward_backward.

        Raises ``ValueError`` for a second adapter (the megatron backend trains one adapter
        per model), a peft directory (continuing an adapter is not supported on MegatronModel
        yet), an empty name, ``is_trainable=False``, a bad `gradient_accumulation_steps`, a
        call after the state is built, and what `twinkle_fn.lora.add_lora` rejects.
        """
        if self._group.name:
            raise ValueError(
                f"this model already trains adapter {self._group.name!r}; the megatron backend "
                "trains one LoRA adapter per model: build another MegatronModel for another "
                "adapter"
            )
        g = _group.Groups(self._group).add(adapter_name, is_trainable, gradient_accumulation_steps)
        if isinstance(config_or_dir, str | os.PathLike):
            raise ValueError(
                f"config_or_dir={os.fspath(config_or_dir)!r}: continuing an adapter from a peft "
                "directory is not supported on MegatronModel yet; pass a LoraConfig (a new "
                "adapter), or continue it with TransformersModel"
            )
        self._check_unbuilt("add_adapter_to_model")
        self._model = tf.lora.add_lora(self._model, config_or_dir, adapter_name)
        self._group = g

    @remote_function(execute="all", sync=True)
    def save(
        self,
        name: str | None = None,
        output_dir: str | os.PathLike[str] | None = None,
        interval: int = 1,
        save_optimizer: bool = False,
        consumed_train_samples: int = 0,
        adapter_name: str | None = None,
    ) -> str | None:
        """Save to ``output_dir/name`` (default ``output/checkpoint-step-<steps>``) when the
        step count is a multiple of `interval`; returns the path (None when skipped).

        The full model is a `twinkle_fn.checkpoint`: megatron's dist checkpoint of model,
        optimizer (whatever `save_optimizer` says), step and RNG states, loadable on another
        tp / pp / dp mesh, plus the HF weights, config and tokenizer at the top of the
        directory, and `consumed_train_samples` for `resume_from_checkpoint`. An adapter is a
        peft directory (``adapter_config.json``, ``adapter_model.safetensors``, tokenizer).
        Every rank must call it. Raises ``ValueError`` for `save_optimizer` with an adapter
        (training states of megatron LoRA are not supported yet) and an unknown adapter.
        """
        g = _group.resolve(self._group, adapter_name)
        if g.name and save_optimizer:
            raise ValueError(
                f"save_optimizer=True with adapter {g.name!r}: training states (dist "
                "checkpoints) of megatron LoRA adapters are not supported yet; save the "
                "adapter with save_optimizer=False"
            )
        state = self._ensure_state()
        path = _checkpoint.save_path(state, name, output_dir, interval)
        if path is None:
            return None
        tokenizer = _inputs.tokenizer(g, self.tokenizer_id)
        _checkpoint.save(state, path, g, tokenizer, save_optimizer, consumed_train_samples)
        return str(path)

    @remote_function(execute="all", sync=True)
    def load(
        self,
        name: str | os.PathLike[str],
        output_dir: str | os.PathLike[str] | None = None,
        load_optimizer: bool = False,
        adapter_name: str | None = None,
    ) -> None:
        """Load a full checkpoint `save` wrote (``output_dir/name``, or `name` itself if it is
        a directory), saved on any mesh. With `load_optimizer`: the whole training state
        (model, optimizer, step; RNG states on the mesh it was saved on). Without: the HF
        weights at the top of the directory only (any HF checkpoint of this model), keeping
        the optimizer state and step. Every rank must call it.

        Raises ``ValueError`` for a model that trains an adapter (loading adapters is not
        supported on MegatronModel yet), a missing directory, one without HF weights or (with
        `load_optimizer`) without a complete megatron checkpoint; the bridge's errors for
        another model's weights.
        """
        g = _group.resolve(self._group, adapter_name)
        if g.name:
            raise ValueError(
                f"load with adapter {g.name!r}: loading adapters into MegatronModel is not "
                "supported yet; load full-model checkpoints into a MegatronModel without one"
            )
        path = _checkpoint.checkpoint_dir(name, output_dir)
        state = self._ensure_state()
        if load_optimizer:
            self._state = tf.checkpoint.load(state, path)
        else:
            tf.checkpoint.load_weights(state, path)

    @remote_function(execute="all", sync=True)
    def resume_from_checkpoint(
        self,
        checkpoint_dir: str | os.PathLike[str],
        *,
        resume_only_model: bool = False,
        adapter_name: str | None = None,
    ) -> dict[str, int]:
        """Restore a full `save` checkpoint (saved on any mesh): weights, and unless
        `resume_only_model` the optimizer state, step and schedule. Returns ``cur_step``,
        ``consumed_train_samples`` and ``gradient_accumulation_steps`` as saved (feed the
        count to ``DataLoader.resume_from_checkpoint``). Raises as `load` does."""
        g = _group.resolve(self._group, adapter_name)
        path = _checkpoint.checkpoint_dir(checkpoint_dir, None)
        self.load(path, load_optimizer=not resume_only_model, adapter_name=adapter_name)
        info = _checkpoint.resume_info(path, g.name)
        g.gradient_accumulation_steps = info["gradient_accumulation_steps"]
        return info

    @remote_function(collect="first")
    def get_state_dict(self, adapter_name: str | None = None) -> dict[str, torch.Tensor]:
        """Whole CPU tensors of what the model trains: every weight by HF name, or with an
        adapter its tensors keyed as in a peft adapter file. A collective on several ranks.
        Raises ``ValueError`` for an unknown adapter."""
        _group.resolve(self._group, adapter_name)
        return tf.unshard(self._ensure_state())

    @remote_function(execute="first")
    def get_train_configs(self, adapter_name: str | None = None) -> str:
        """A readable summary of how this model trains."""
        g = _group.resolve(self._group, adapter_name)
        lines = [
            f"model: {self.model_id or 'from config'} ({self._model.family}, megatron-core)",
            f"device_mesh: {self.device_mesh}",
            f"mixed_precision: {self.mixed_precision}",
            f"megatron options: {dict(self._model.options)}",
            *_group.describe(g),
        ]
        return "\n".join(lines)


_TOGETHER = (
    "MegatronModel.{} is not available: megatron runs forward and backward together in its "
    "pipeline schedule; call forward_backward(inputs=...) (forward_only(inputs=...) to evaluate)"
)


def _chunks(inputs: Any, micro_batch_size: int | None) -> list[Any]:
    """`inputs` whole, or as lists of `micro_batch_size` samples."""
    if micro_batch_size is None:
        return [inputs]
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int):
        raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    if isinstance(inputs, Mapping) or not isinstance(inputs, Sequence):
        raise TypeError("micro_batch_size needs inputs as a list of features / trajectories")
    return [inputs[i : i + micro_batch_size] for i in range(0, len(inputs), micro_batch_size)]


def _stack_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[n_i, len_i]`` pieces as one ``[sum n_i, max len_i]`` tensor, zeros past each row."""
    width = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])
