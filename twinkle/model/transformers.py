"""`TransformersModel`: upstream Twinkle's stateful model class over `twinkle_fn`.

The object holds a `TrainState` (built lazily, on the first call that needs it, so adapters and
optimizer settings can be set first) and the pending `Grads`; each method calls the core:

- ``forward_backward`` = ``tf.fwd_bwd(state, batch, accum=pending)``;
- ``clip_grad_and_step`` = ``tf.step(state, pending)`` once exactly N micro-batches are pending
  (N = ``gradient_accumulation_steps``), so the update is normalised over the tokens of all N.
  Upstream steps one micro-batch late (its first sync comes at micro-batch N + 1); this does not;
- ``save``/``load`` = `twinkle_fn.checkpoint` (full model) or `twinkle_fn.backends.transformers.lora` (adapter).

Several LoRA adapters may share the model (``add_adapter_to_model`` once per name, before the
first forward): each adapter is an optimizer group with its own train state (its weights only,
its optimizer state, schedule and step), pending gradients, accumulation steps, template and
processor. A call with ``adapter_name=X`` computes with X alone active (`twinkle_fn.backends.transformers.lora`), so
only X's weights get gradients and only X's optimizer steps; the base weights never change.
Without ``adapter_name`` a call uses the last adapter added (upstream's active group).

Differences from upstream, by design of the core: the loss is the causal-LM cross entropy fused
into the lm_head (`set_loss` accepts only that); ``forward``/``calculate_loss``/``backward`` are
kept, but the gradient comes from one ``tf.fwd_bwd`` in ``backward`` (so that path runs the
forward twice: ``forward_backward`` runs it once); log-probs and logits are computed by an extra
no-grad forward only when asked for (``return_logps=True`` / ``return_logits=True``); the lr
schedule is a function of the optimizer's update count, so ``lr_step`` has nothing left to do;
once an adapter is added, the full-parameter group ``''`` no longer trains.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, PretrainedConfig

import twinkle_fn as tf
from twinkle.data_format import ModelOutput
from twinkle.device_mesh import DeviceMesh
from twinkle.infra import remote_class, remote_function, settings
from twinkle.model import _accumulate, _build, _checkpoint, _group, _inputs, optim
from twinkle.model._inputs import Batch
from twinkle.processor import InputProcessor


@remote_class()
class TransformersModel:
    """A transformers causal LM trained through `twinkle_fn`, with upstream Twinkle's methods.

    `model_id`: a local HF directory or ``hf://``/``ms://`` id (`tf.models.from_pretrained`);
    else `config` (an HF config) builds a random init. `model_cls` must name a causal LM (the
    core builds ``AutoModelForCausalLM``). `device_mesh` (default: the mesh of
    `twinkle.initialize`, else dp over the torch.distributed world) must match the world.
    `mixed_precision`: ``'no'``, ``'bf16'`` or ``'fp16'`` autocast over float32 master weights.
    `strategy`: ``'accelerate'`` or ``'native_fsdp'``, both FSDP2/DTensor through the core.
    `fsdp_config`: ``{"activation_checkpointing": bool}``. Extra keyword arguments:
    ``tokenizer_id``, ``seed`` (random init and dropout; default the `initialize` seed),
    ``dtype``/``torch_dtype`` (parameter dtype, e.g. float64 for exact tests), and, with
    `config`, fields of the config to override. Raises ``ValueError`` for what the core does
    not do (fp8, grad scaler, DDP options, a non-causal-LM class) and for a mesh that does not
    match the world.
    """

    def __init__(
        self,
        model_cls: Any = AutoModelForCausalLM,
        model_id: str | os.PathLike[str] | None = None,
        config: PretrainedConfig | None = None,
        device_mesh: DeviceMesh | None = None,
        mixed_precision: str = "bf16",
        strategy: str = "accelerate",
        ddp_config: Mapping[str, Any] | None = None,
        fsdp_config: Mapping[str, Any] | None = None,
        grad_scaler_config: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        fsdp_config = _build.check_options(
            model_cls, mixed_precision, strategy, ddp_config, fsdp_config, grad_scaler_config
        )
        self.device_mesh = _build.device_mesh(device_mesh)
        self.mixed_precision, self.strategy = mixed_precision, strategy
        self.model_id = None if model_id is None else os.fspath(model_id)
        self.tokenizer_id = kwargs.pop("tokenizer_id", self.model_id)
        self._seed = kwargs.pop("seed", settings().seed)
        self._model = _build.build_model(
            model_id, config, kwargs, mixed_precision, fsdp_config, self._seed
        )
        self._groups = _group.Groups(_group.Group(processor=InputProcessor(self.device_mesh)))

    # The model and its state.
    @property
    def model(self) -> torch.nn.Module:
        """The transformers module (sharded in place once the states are built)."""
        return self._model.module

    @property
    def state(self) -> tf.TrainState:
        """The current `twinkle_fn.TrainState` of the default group (the last adapter added;
        built on first access). `state_of` gives another adapter's."""
        return self._ensure_state(self._resolve(None))

    def state_of(self, adapter_name: str | None = None) -> tf.TrainState:
        """The current `twinkle_fn.TrainState` of adapter `adapter_name` (its weights,
        optimizer state and step). Raises ``ValueError`` for an unknown adapter."""
        return self._ensure_state(self._resolve(adapter_name))

    def _ensure_state(self, g: _group.Group) -> tf.TrainState:
        if g.state is None:
            mesh = self.device_mesh.mesh
            self._model = _group.build_states(self._model, self._groups, mesh, self._seed)
        assert g.state is not None
        return g.state

    def _resolve(self, adapter_name: str | None) -> _group.Group:
        return self._groups.resolve(adapter_name)

    def _encode(self, adapter_name: str | None, inputs: Any) -> tuple[_group.Group, Batch]:
        g = self._resolve(adapter_name)
        return g, _inputs.encode(g, self.tokenizer_id, inputs)

    # Training calls.
    @remote_function(dispatch="slice_dp", collect="mean")
    def forward_backward(
        self,
        *,
        inputs: Any,
        adapter_name: str | None = None,
        return_logps: bool = False,
        return_logits: bool = False,
        temperature: float = 1.0,
        gradient_accumulation_steps: int | None = None,
    ) -> ModelOutput:
        """Forward and backward on this rank's `inputs`, adding the gradients to the pending ones.

        `inputs`: feature dicts (``input_ids`` and already-shifted ``labels``), chat
        trajectories (``messages``, encoded by the template) or a collated batch. Returns
        ``loss`` (this call's token mean on this rank, a float) and ``num_tokens``; with
        `return_logps` / `return_logits` also ``logps`` / ``logits`` from an extra no-grad
        forward (with the weights the gradient is taken at). `gradient_accumulation_steps` is
        read at step time.
        """
        g, batch = self._encode(adapter_name, inputs)
        state = self._ensure_state(g)
        out = _inputs.requested_outputs(state, batch, temperature, return_logps, return_logits)
        aux = g.pending.add(state, batch)
        out.update(_accumulate.read_loss(aux["loss_sum"], aux["num_tokens"]))
        g.last = (batch, out, False)
        return out

    @remote_function(dispatch="slice_dp", collect="flatten")
    def forward(
        self,
        *,
        inputs: Any,
        adapter_name: str | None = None,
        return_logits: bool = False,
        temperature: float = 1.0,
    ) -> ModelOutput:
        """A training forward: returns ``logps`` (and ``logits`` if asked); `backward` then
        takes the gradient of these inputs. No gradient is kept from this call itself."""
        g, batch = self._encode(adapter_name, inputs)
        out = _inputs.outputs(self._ensure_state(g), batch, temperature, return_logits)
        g.last = (batch, out, True)
        return out

    @remote_function(dispatch="slice_dp", collect="flatten")
    def forward_only(
        self,
        *,
        inputs: Any,
        adapter_name: str | None = None,
        return_logits: bool = False,
        temperature: float = 1.0,
        disable_lora: bool = False,
    ) -> ModelOutput:
        """An evaluation forward (no gradient): ``logps``, ``loss``, ``num_tokens`` (and
        ``logits`` if asked). `disable_lora` uses the base weights (reference log-probs)."""
        g, batch = self._encode(adapter_name, inputs)
        state = self._ensure_state(g)
        out = _inputs.outputs(state, batch, temperature, return_logits, disable_lora)
        g.last = (batch, out, False)
        _group.add_eval(g, out)
        return out

    @remote_function(collect="mean")
    def calculate_loss(self, adapter_name: str | None = None, **loss_kwargs: Any) -> float:
        """The token-mean cross entropy of the last `forward`/`forward_only` on this rank.

        Raises ``ValueError`` before any forward, and ``TypeError`` for loss arguments (the
        cross entropy takes none).
        """
        if loss_kwargs:
            raise TypeError(f"the cross-entropy loss takes no arguments, got {sorted(loss_kwargs)}")
        return _group.last_loss(self._resolve(adapter_name))

    @remote_function()
    def backward(
        self, adapter_name: str | None = None, gradient_accumulation_steps: int | None = None
    ) -> None:
        """Add the gradient of the last `forward`'s inputs to the pending gradients.

        Raises ``ValueError`` unless the last call was `forward` (not `forward_only`, and not
        already backpropagated).
        """
        g = self._resolve(adapter_name)
        if g.last is None or not g.last[2]:
            raise ValueError("backward needs a forward(inputs=...) call before it")
        g.pending.add(self._ensure_state(g), g.last[0])
        g.last = (g.last[0], g.last[1], False)

    def _due(
        self, adapter_name: str | None, gradient_accumulation_steps: int | None
    ) -> _group.Group | None:
        """The adapter's group when its pending gradients hold (at least) the micro-batches of
        one step, else None."""
        g = self._resolve(adapter_name)
        gas = _group.accumulation_steps(g, gradient_accumulation_steps)
        return g if g.pending.due(gas) else None

    @remote_function()
    def clip_grad_norm(
        self,
        max_grad_norm: float = 1.0,
        norm_type: float = 2,
        adapter_name: str | None = None,
        gradient_accumulation_steps: int | None = None,
    ) -> float | None:
        """On a step boundary: clip the coming step's gradients to `max_grad_norm` (global L2
        norm of the token-normalised gradients) and return their norm before clipping; None
        while micro-batches are still accumulating. Raises ``ValueError`` for norm_type != 2.
        """
        g = self._due(adapter_name, gradient_accumulation_steps)
        if g is None:
            return None
        g.pending.set_clip(max_grad_norm, norm_type)
        return g.pending.grad_norm(self._ensure_state(g))

    @remote_function()
    def step(
        self,
        adapter_name: str | None = None,
        gradient_accumulation_steps: int | None = None,
        **kwargs: Any,
    ) -> None:
        """On a step boundary (exactly `gradient_accumulation_steps` micro-batches pending):
        one optimizer update from the pending gradients, normalised by all their tokens;
        otherwise nothing. Raises ``ValueError`` for ``optim_params`` (set them with
        `set_optimizer`)."""
        if kwargs:
            raise ValueError(
                f"step() options {sorted(kwargs)} are not supported; call set_optimizer(...) "
                "to change the learning rate or weight decay"
            )
        g = self._due(adapter_name, gradient_accumulation_steps)
        if g is not None:
            _group.step(g)

    @remote_function()
    def zero_grad(
        self,
        adapter_name: str | None = None,
        gradient_accumulation_steps: int | None = None,
        set_to_none: bool = True,
    ) -> None:
        """On a step boundary, drop the pending gradients (`step` already consumed them)."""
        g = self._due(adapter_name, gradient_accumulation_steps)
        if g is not None:
            g.pending.clear()

    @remote_function()
    def lr_step(
        self, adapter_name: str | None = None, gradient_accumulation_steps: int | None = None
    ) -> None:
        """Nothing to do: the schedule is a function of the update count, so each `step`
        already moves the learning rate on (as a torch scheduler stepped after it would)."""
        self._resolve(adapter_name)

    @remote_function(dispatch="all")
    def clip_grad_and_step(
        self,
        max_grad_norm: float = 1.0,
        norm_type: float = 2,
        adapter_name: str | None = None,
        gradient_accumulation_steps: int | None = None,
    ) -> float | None:
        """`clip_grad_norm`, `step`, `zero_grad`, `lr_step` after exactly
        `gradient_accumulation_steps` micro-batches (default: the group's); returns the
        gradient norm before clipping, or None while still accumulating."""
        g = self._due(adapter_name, gradient_accumulation_steps)
        if g is None:
            return None
        g.pending.set_clip(max_grad_norm, norm_type)
        _group.step(g)
        return float(g.pending.last_step["grad_norm"])

    @remote_function(collect="first")
    def calculate_metric(self, is_training: bool = True, adapter_name: str | None = None) -> dict:
        """Training: the last step's ``loss`` (token mean over its micro-batches and data
        ranks), ``grad_norm``, ``lr``, ``num_tokens`` and ``step``. Evaluation: the token-mean
        ``loss`` over this rank's `forward_only` calls since the last call (then reset)."""
        g = self._resolve(adapter_name)
        return g.pending.metrics() if is_training else _group.pop_eval(g)

    # Settings.
    @remote_function()
    def set_optimizer(self, optimizer_cls: Any, **kwargs: Any) -> None:
        """Use optimizer `optimizer_cls` ('AdamW', 'default' = AdamW, 'SGD', or those torch
        classes) with torch's keyword arguments (default lr 1e-5, weight_decay 0.01 on
        matrices). A state that already exists gets a fresh optimizer state, as upstream's new
        optimizer. Raises ``ValueError`` for an unknown optimizer, listing the known ones."""
        g = self._resolve(kwargs.pop("adapter_name", None))
        g.optimizer = optim.optimizer_spec(optimizer_cls, **kwargs)
        if g.state is not None:
            tx = _group.transform(g, None)
            g.state = g.state.replace(tx=tx, opt_state=tx.init(g.state.params))

    @remote_function()
    def set_lr_scheduler(self, scheduler_cls: Any, **kwargs: Any) -> None:
        """Schedule the learning rate with `scheduler_cls` ('CosineWarmupScheduler',
        'LinearWarmupScheduler', 'default'/'OptimizerParamScheduler' with Megatron's arguments,
        'CosineAnnealingLR', 'LinearLR'), peaking at the optimizer's lr and counted in
        optimizer steps. Raises ``ValueError`` for an unknown scheduler, listing the known
        ones."""
        g = self._resolve(kwargs.pop("adapter_name", None))
        _group.set_scheduler(g, scheduler_cls, kwargs)
        if g.state is not None:
            g.state = g.state.replace(tx=_group.transform(g, None))

    @remote_function()
    def set_loss(self, loss_cls: Any, **kwargs: Any) -> None:
        """Accepts the cross entropy ('CrossEntropyLoss' / 'cross_entropy'), the only loss of
        this build (fused into the lm_head). Raises ``ValueError`` for any other loss, or for
        an ``ignore_index`` other than -100."""
        self._resolve(kwargs.pop("adapter_name", None))
        _group.check_loss(loss_cls, kwargs)

    @remote_function()
    def set_template(self, template_cls: Any = "Template", **kwargs: Any) -> None:
        """Encode chat trajectories with a `Template` (an instance, or the class / 'Template'
        built with `kwargs`; ``model_id`` defaults to this model's tokenizer)."""
        g = self._resolve(kwargs.pop("adapter_name", None))
        g.template = _inputs.make_group_template(template_cls, self.tokenizer_id, kwargs)

    @remote_function()
    def set_processor(self, processor_cls: Any = "InputProcessor", **kwargs: Any) -> None:
        """Collate with an `InputProcessor` (an instance, or the class / 'InputProcessor' built
        with `kwargs`, e.g. ``padding_free=True``). Raises ``ValueError`` for anything else."""
        g = self._resolve(kwargs.pop("adapter_name", None))
        g.processor = _inputs.make_processor(processor_cls, self.device_mesh, kwargs)

    @remote_function()
    def add_adapter_to_model(
        self,
        adapter_name: str,
        config_or_dir: LoraConfig | Mapping[str, Any] | str | os.PathLike[str],
        is_trainable: bool = True,
        gradient_accumulation_steps: int = 1,
    ) -> None:
        """Add LoRA adapter `adapter_name` (a ``LoraConfig``, its fields as a dict, or a peft
        adapter directory to continue from) as a new optimizer group, the default one from now
        on (calls without ``adapter_name`` use it).

        The group starts with the settings made before the first adapter was added
        (optimizer, scheduler, template, processor); change them per adapter with
        ``adapter_name=``. The adapter's ``lora_A`` init draws from torch's global generator.
        Raises ``ValueError`` for an empty or taken name (listing the adapters there), an
        adapter added after the states were built (add adapters before the first forward),
        ``is_trainable=False``, and what `twinkle_fn.backends.transformers.lora.add_lora` rejects.
        """
        g = self._groups.add(adapter_name, is_trainable, gradient_accumulation_steps)
        self._model = _checkpoint.add_adapter(self._model, adapter_name, config_or_dir)
        self._groups.register(g)

    # Checkpoints.
    @remote_function(execute="all")
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

        A full model is a `twinkle_fn.checkpoint` (HF weights + config + tokenizer, plus the
        optimizer state and step, whatever `save_optimizer` says). An adapter is a peft
        directory (``adapter_config.json``, ``adapter_model.safetensors``, tokenizer), plus
        with `save_optimizer` a ``train_state/`` checkpoint to resume from. Every rank must
        call it.
        """
        g = self._resolve(adapter_name)
        state = self._ensure_state(g)
        path = _checkpoint.save_path(state, name, output_dir, interval)
        if path is None:
            return None
        tokenizer = _inputs.tokenizer(g, self.tokenizer_id)
        _checkpoint.save(state, path, g, tokenizer, save_optimizer, consumed_train_samples)
        return str(path)

    @remote_function(execute="all")
    def load(
        self,
        name: str | os.PathLike[str],
        output_dir: str | os.PathLike[str] | None = None,
        load_optimizer: bool = False,
        adapter_name: str | None = None,
    ) -> None:
        """Load the weights `save` wrote (``output_dir/name``, or `name` itself if it is a
        directory); with `load_optimizer` also the optimizer state and step. Every rank must
        call it. Raises ``ValueError`` for a missing or incompatible checkpoint."""
        g = self._resolve(adapter_name)
        path = _checkpoint.checkpoint_dir(name, output_dir)
        state = self._ensure_state(g)
        others = [o.state for o in self._groups if o is not g and o.state is not None]
        g.state = _checkpoint.load(
            state, path, adapter_name=g.name, load_optimizer=load_optimizer, others=others
        )

    @remote_function(execute="all")
    def resume_from_checkpoint(
        self,
        checkpoint_dir: str | os.PathLike[str],
        *,
        resume_only_model: bool = False,
        adapter_name: str | None = None,
    ) -> dict[str, int]:
        """Restore a `save(save_optimizer=True)` checkpoint: weights, and unless
        `resume_only_model` the optimizer state and step. Returns ``cur_step``,
        ``consumed_train_samples`` and ``gradient_accumulation_steps`` as saved (feed the
        count to ``DataLoader.resume_from_checkpoint``)."""
        g = self._resolve(adapter_name)
        path = _checkpoint.checkpoint_dir(checkpoint_dir, None)
        self.load(path, load_optimizer=not resume_only_model, adapter_name=adapter_name)
        info = _checkpoint.resume_info(path, g.name)
        g.gradient_accumulation_steps = info["gradient_accumulation_steps"]
        return info

    @remote_function(collect="first")
    def get_state_dict(self, adapter_name: str | None = None) -> dict[str, torch.Tensor]:
        """The trainable parameters of adapter `adapter_name` (default: the last added; the
        whole model's without adapters) as whole tensors, by module name (``...lora_A.<adapter
        name>.weight``). A collective on several ranks. Raises ``ValueError`` for an unknown
        adapter, listing the adapters there are."""
        return tf.unshard(self._ensure_state(self._resolve(adapter_name)))

    @remote_function(execute="first")
    def get_train_configs(self, adapter_name: str | None = None) -> str:
        """A readable summary of how this model trains."""
        g = self._resolve(adapter_name)
        lines = [
            f"model: {self.model_id or type(self.model).__name__} ({self._model.family})",
            f"device_mesh: {self.device_mesh}",
            f"mixed_precision: {self.mixed_precision}, strategy: {self.strategy} (FSDP2 core)",
            f"adapters: {self._groups.adapter_names or 'none'}",
            *_group.describe(g),
        ]
        return "\n".join(lines)
