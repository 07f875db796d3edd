"""`TransformersModel`: upstream Twinkle's stateful model class over `twinkle_fn`.

The object holds a `TrainState` (built lazily, on the first call that needs it, so adapters and
optimizer settings can be set first) and the pending `Grads`; each method calls the core:

- ``forward_backward`` = ``tf.fwd_bwd(state, batch, accum=pending)``;
- ``clip_grad_and_step`` = ``tf.step(state, pending)`` once exactly N micro-batches are pending
  (N = ``gradient_accumulation_steps``), so the update is normalised over the tokens of all N.
  Upstream steps one micro-batch late (its first sync comes at micro-batch N + 1); this does not;
- ``save``/``load`` = `twinkle_fn.checkpoint` (full model) or `twinkle_fn.lora` (adapter).

Differences from upstream, by design of the core: the loss is the causal-LM cross entropy fused
into the lm_head (`set_loss` accepts only that); ``forward``/``calculate_loss``/``backward`` are
kept, but the gradient comes from one ``tf.fwd_bwd`` in ``backward`` (so that path runs the
forward twice: ``forward_backward`` runs it once); log-probs and logits are computed by an extra
no-grad forward only when asked for (``return_logps=True`` / ``return_logits=True``); the lr
schedule is a function of the optimizer's update count, so ``lr_step`` has nothing left to do;
one LoRA adapter per model.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, PretrainedConfig

import twinkle_fn as tf
from twinkle.data_format import ModelOutput
from twinkle.dataset import make_template
from twinkle.device_mesh import DeviceMesh, current_rank
from twinkle.infra import remote_class, remote_function, settings
from twinkle.model import _core_ops, optim
from twinkle.processor import InputProcessor, unpack
from twinkle.template import Template
from twinkle_fn.data import IGNORE_INDEX
from twinkle_fn.distributed import init_distributed, world_size
from twinkle_fn.optim import Schedule

PRECISIONS = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}
STRATEGIES = ("accelerate", "native_fsdp")
FSDP_OPTIONS = ("activation_checkpointing",)
LOSSES = ("CrossEntropyLoss", "cross_entropy")
TRAIN_STATE_DIR = "train_state"  # next to a saved adapter: its optimizer state and step


@dataclasses.dataclass
class _Group:
    """Upstream's optimizer group: what one adapter (or ``''``, the full model) trains with."""

    name: str = ""
    gradient_accumulation_steps: int = 1
    optimizer: optim.OptimizerSpec = dataclasses.field(
        default_factory=lambda: optim.optimizer_spec("AdamW")
    )
    scheduler: tuple[Any, dict[str, Any]] | None = None
    template: Template | None = None
    processor: InputProcessor | None = None
    last: tuple[dict[str, torch.Tensor], ModelOutput, bool] | None = None  # batch, out, train
    eval_sums: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.0])


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
        _check_options(model_cls, mixed_precision, strategy, ddp_config, grad_scaler_config)
        fsdp_config = dict(fsdp_config or {})
        unknown = sorted(set(fsdp_config) - set(FSDP_OPTIONS))
        if unknown:
            raise ValueError(f"fsdp_config keys {unknown} are not supported; known: {FSDP_OPTIONS}")
        init_distributed()  # joins the launcher's world (torchrun); nothing on one process
        self.device_mesh = device_mesh or DeviceMesh.from_sizes(dp_size=world_size())
        self.device_mesh.mesh.validate(world_size())
        self.mixed_precision = mixed_precision
        self.strategy = strategy
        self.model_id = None if model_id is None else os.fspath(model_id)
        self.tokenizer_id = kwargs.pop("tokenizer_id", self.model_id)
        self._seed = kwargs.pop("seed", settings().seed)
        dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", None))
        build = dict(
            precision=PRECISIONS[mixed_precision],
            activation_checkpointing=bool(fsdp_config.get("activation_checkpointing", False)),
        )
        if model_id is not None:
            if config is not None or kwargs:
                raise ValueError(
                    "with model_id, the directory's config.json is used; config= and config "
                    f"overrides {sorted(kwargs)} are not supported (build from config= instead)"
                )
            self._model = tf.models.from_pretrained(model_id, **build)
        elif config is not None:
            self._model = tf.models.from_hf_config(
                _override(config, kwargs), seed=self._seed, **build
            )
        else:
            raise ValueError("TransformersModel needs model_id=<dir or hub id> or config=")
        if dtype is not None:
            self._model.module.to(dtype)
        self._group = _Group(processor=InputProcessor(self.device_mesh))
        self._state: tf.TrainState | None = None
        self._grads: tf.Grads | None = None
        self._clip: float | None = None
        self._last_step: dict[str, Any] = {}

    # The model and its state.
    @property
    def model(self) -> torch.nn.Module:
        """The transformers module (sharded in place once the state is built)."""
        return self._model.module if self._state is None else self._state.model.module

    @property
    def state(self) -> tf.TrainState:
        """The current `twinkle_fn.TrainState` (built on first access)."""
        return self._ensure_state()

    def _ensure_state(self) -> tf.TrainState:
        if self._state is None:
            tx = optim.transform(self._group.optimizer, self._lr(), None)
            self._state = tf.init(self._model, tx, self.device_mesh.mesh, seed=self._seed)
        return self._state

    def _lr(self) -> float | Schedule:
        g = self._group
        if g.scheduler is None:
            return g.optimizer.lr
        cls, kwargs = g.scheduler
        return optim.schedule(cls, g.optimizer.lr, **kwargs)

    def _resolve(self, adapter_name: str | None) -> _Group:
        g = self._group
        if adapter_name is None or adapter_name == g.name:
            return g
        if adapter_name == "" and g.name:
            raise ValueError(
                f"this model trains adapter {g.name!r}; the full-parameter group '' no longer "
                f"trains (one adapter per model in this build): pass adapter_name={g.name!r}"
            )
        have = repr(g.name) if g.name else "no adapter (only the default group '')"
        raise ValueError(
            f"adapter {adapter_name!r} does not exist; this model has {have}. Add it with "
            "add_adapter_to_model(name, LoraConfig(...)) before training"
        )

    # Inputs.
    def _template(self, g: _Group) -> Template:
        if g.template is None:
            if self.tokenizer_id is None:
                raise ValueError(
                    "chat trajectories need a template; call set_template('Template', "
                    "model_id=<tokenizer dir>) (this model was built from a config)"
                )
            g.template = Template(self.tokenizer_id)
        return g.template

    def _batch(self, g: _Group, inputs: Any) -> dict[str, torch.Tensor]:
        """`inputs` (features, trajectories, or a collated batch) as the core's batch."""
        if isinstance(inputs, Mapping):
            if "messages" not in inputs:
                return g.processor(inputs)  # one feature, or a collated batch
            inputs = [inputs]
        if not isinstance(inputs, Sequence) or isinstance(inputs, str):
            raise TypeError(
                "inputs must be a list of features / trajectories or a collated batch, got "
                f"{type(inputs).__name__}"
            )
        if inputs and isinstance(inputs[0], Mapping) and "input_ids" not in inputs[0]:
            inputs = self._template(g).batch_encode(inputs)
        if not inputs:
            raise ValueError(
                "inputs is empty (or the template deleted every sample); each rank needs at "
                "least one sample per call"
            )
        return g.processor(inputs)

    def _outputs(
        self,
        batch: dict[str, torch.Tensor],
        temperature: float,
        return_logits: bool,
        disable_lora: bool = False,
    ) -> ModelOutput:
        """The no-grad forward's ``logps`` ([n_seq, max_len]), ``loss``, ``num_tokens`` and,
        when asked, ``logits``."""
        logps, logits = _core_ops.forward_logps(
            self._ensure_state(),
            batch,
            temperature=temperature,
            return_logits=return_logits,
            disable_lora=disable_lora,
        )
        num_tokens = int((batch["labels"] != IGNORE_INDEX).sum())
        out = ModelOutput(
            logps=unpack(logps, batch),
            loss=float(-logps.sum()) / max(num_tokens, 1),
            num_tokens=num_tokens,
        )
        if logits is not None:
            out["logits"] = logits
        return out

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
        ``loss`` (this call's token mean on this rank) and ``num_tokens``; with `return_logps`
        / `return_logits` also ``logps`` / ``logits`` from an extra no-grad forward (with the
        weights the gradient is taken at). `gradient_accumulation_steps` is read at step time.
        """
        g = self._resolve(adapter_name)
        batch = self._batch(g, inputs)
        state = self._ensure_state()
        out = ModelOutput()
        if return_logps or return_logits:
            out = self._outputs(batch, temperature, return_logits)
            if not return_logps:
                del out["logps"]
        self._grads, aux = tf.fwd_bwd(state, batch, accum=self._grads)
        num_tokens = int(aux["num_tokens"])
        out.update(loss=float(aux["loss_sum"]) / max(num_tokens, 1), num_tokens=num_tokens)
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
        g = self._resolve(adapter_name)
        batch = self._batch(g, inputs)
        out = self._outputs(batch, temperature, return_logits)
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
        g = self._resolve(adapter_name)
        batch = self._batch(g, inputs)
        out = self._outputs(batch, temperature, return_logits, disable_lora)
        g.last = (batch, out, False)
        g.eval_sums[0] += out["loss"] * out["num_tokens"]
        g.eval_sums[1] += out["num_tokens"]
        return out

    @remote_function(collect="mean")
    def calculate_loss(self, adapter_name: str | None = None, **loss_kwargs: Any) -> float:
        """The token-mean cross entropy of the last `forward`/`forward_only` on this rank.

        Raises ``ValueError`` before any forward, and ``TypeError`` for loss arguments (the
        cross entropy takes none).
        """
        if loss_kwargs:
            raise TypeError(f"the cross-entropy loss takes no arguments, got {sorted(loss_kwargs)}")
        g = self._resolve(adapter_name)
        if g.last is None:
            raise ValueError("calculate_loss needs a forward/forward_only call first")
        return g.last[1]["loss"]

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
        self._grads, _ = tf.fwd_bwd(self._ensure_state(), g.last[0], accum=self._grads)
        g.last = (g.last[0], g.last[1], False)

    def _gas(self, g: _Group, gradient_accumulation_steps: int | None) -> int:
        gas = gradient_accumulation_steps or g.gradient_accumulation_steps
        if isinstance(gas, bool) or not isinstance(gas, int) or gas < 1:
            raise ValueError(f"gradient_accumulation_steps must be a positive int, got {gas!r}")
        return gas

    def _due(self, adapter_name: str | None, gradient_accumulation_steps: int | None) -> bool:
        """Whether the pending gradients hold (at least) the micro-batches of one step."""
        gas = self._gas(self._resolve(adapter_name), gradient_accumulation_steps)
        return self._grads is not None and self._grads.num_micro_batches >= gas

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
        if not self._due(adapter_name, gradient_accumulation_steps):
            return None
        _check_norm_type(norm_type)
        self._clip = max_grad_norm
        assert self._grads is not None
        return float(_core_ops.grad_norm(self._ensure_state(), self._grads))

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
        if not self._due(adapter_name, gradient_accumulation_steps):
            return
        assert self._grads is not None
        state = self._ensure_state()
        state = state.replace(tx=optim.transform(self._group.optimizer, self._lr(), self._clip))
        self._state, info = tf.step(state, self._grads)
        self._grads, self._clip = None, None
        self._last_step = {
            "loss": float(info["loss"]),
            "grad_norm": float(info["grad_norm"]),
            "lr": info["lr"],
            "num_tokens": int(info["num_tokens"]),
            "step": int(self._state.step),
        }

    @remote_function()
    def zero_grad(
        self,
        adapter_name: str | None = None,
        gradient_accumulation_steps: int | None = None,
        set_to_none: bool = True,
    ) -> None:
        """On a step boundary, drop the pending gradients (`step` already consumed them)."""
        if self._due(adapter_name, gradient_accumulation_steps):
            self._grads, self._clip = None, None

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
        if not self._due(adapter_name, gradient_accumulation_steps):
            return None
        _check_norm_type(norm_type)
        self._clip = max_grad_norm
        self.step(adapter_name, gradient_accumulation_steps)
        return self._last_step["grad_norm"]

    @remote_function(collect="first")
    def calculate_metric(self, is_training: bool = True, adapter_name: str | None = None) -> dict:
        """Training: the last step's ``loss`` (token mean over its micro-batches and data
        ranks), ``grad_norm``, ``lr``, ``num_tokens`` and ``step``. Evaluation: the token-mean
        ``loss`` over this rank's `forward_only` calls since the last call (then reset)."""
        g = self._resolve(adapter_name)
        if is_training:
            return dict(self._last_step)
        loss_sum, num_tokens = g.eval_sums
        g.eval_sums = [0.0, 0.0]
        return {"loss": loss_sum / max(num_tokens, 1.0), "num_tokens": int(num_tokens)}

    # Settings.
    @remote_function()
    def set_optimizer(self, optimizer_cls: Any, **kwargs: Any) -> None:
        """Use optimizer `optimizer_cls` ('AdamW', 'default' = AdamW, 'SGD', or those torch
        classes) with torch's keyword arguments (default lr 1e-5, weight_decay 0.01 on
        matrices). A state that already exists gets a fresh optimizer state, as upstream's new
        optimizer. Raises ``ValueError`` for an unknown optimizer, listing the known ones."""
        g = self._resolve(kwargs.pop("adapter_name", None))
        g.optimizer = optim.optimizer_spec(optimizer_cls, **kwargs)
        if self._state is not None:
            tx = optim.transform(g.optimizer, self._lr(), None)
            self._state = self._state.replace(tx=tx, opt_state=tx.init(self._state.params))

    @remote_function()
    def set_lr_scheduler(self, scheduler_cls: Any, **kwargs: Any) -> None:
        """Schedule the learning rate with `scheduler_cls` ('CosineWarmupScheduler',
        'LinearWarmupScheduler', 'default'/'OptimizerParamScheduler' with Megatron's arguments,
        'CosineAnnealingLR', 'LinearLR'), peaking at the optimizer's lr and counted in
        optimizer steps. Raises ``ValueError`` for an unknown scheduler, listing the known
        ones."""
        g = self._resolve(kwargs.pop("adapter_name", None))
        optim.schedule(scheduler_cls, g.optimizer.lr, **kwargs)
        g.scheduler = (scheduler_cls, kwargs)
        if self._state is not None:
            self._state = self._state.replace(tx=optim.transform(g.optimizer, self._lr(), None))

    @remote_function()
    def set_loss(self, loss_cls: Any, **kwargs: Any) -> None:
        """Accepts the cross entropy ('CrossEntropyLoss' / 'cross_entropy'), the only loss of
        this build (fused into the lm_head). Raises ``ValueError`` for any other loss, or for
        an ``ignore_index`` other than -100."""
        self._resolve(kwargs.pop("adapter_name", None))
        name = loss_cls if isinstance(loss_cls, str) else getattr(loss_cls, "__name__", "")
        if name not in LOSSES:
            raise ValueError(
                f"loss {loss_cls!r} is not available; this build trains with the causal-LM "
                f"cross entropy only ({' / '.join(LOSSES)})"
            )
        if kwargs.get("ignore_index", -100) != -100:
            raise ValueError(f"ignore_index must be -100, got {kwargs['ignore_index']}")

    @remote_function()
    def set_template(self, template_cls: Any = "Template", **kwargs: Any) -> None:
        """Encode chat trajectories with a `Template` (an instance, or the class / 'Template'
        built with `kwargs`; ``model_id`` defaults to this model's tokenizer)."""
        g = self._resolve(kwargs.pop("adapter_name", None))
        if not isinstance(template_cls, Template):
            kwargs.setdefault("model_id", self.tokenizer_id)
        g.template = make_template(template_cls, **kwargs)

    @remote_function()
    def set_processor(self, processor_cls: Any = "InputProcessor", **kwargs: Any) -> None:
        """Collate with an `InputProcessor` (an instance, or the class / 'InputProcessor' built
        with `kwargs`, e.g. ``padding_free=True``). Raises ``ValueError`` for anything else."""
        g = self._resolve(kwargs.pop("adapter_name", None))
        if isinstance(processor_cls, InputProcessor):
            g.processor = processor_cls
        elif processor_cls in ("InputProcessor", InputProcessor):
            kwargs.setdefault("device_mesh", self.device_mesh)
            g.processor = InputProcessor(**kwargs)
        else:
            raise ValueError(f"unknown processor {processor_cls!r}; use 'InputProcessor'")

    @remote_function()
    def add_adapter_to_model(
        self,
        adapter_name: str,
        config_or_dir: LoraConfig | Mapping[str, Any] | str | os.PathLike[str],
        is_trainable: bool = True,
        gradient_accumulation_steps: int = 1,
    ) -> None:
        """Add LoRA adapter `adapter_name` (a ``LoraConfig``, its fields as a dict, or a peft
        adapter directory to continue from) and train only it from now on.

        The group keeps the settings made so far (optimizer, scheduler, template, processor).
        Raises ``ValueError`` for an empty name, a second adapter (one per model in this
        build), an adapter added after the state was built (add adapters before the first
        forward), ``is_trainable=False``, and what `twinkle_fn.lora.add_lora` rejects.
        """
        if not isinstance(adapter_name, str) or not adapter_name:
            raise ValueError(f"adapter_name must be a non-empty str, got {adapter_name!r}")
        g = self._group
        if g.name:
            raise ValueError(
                f"this model already has adapter {g.name!r}; this build trains one adapter per "
                "model (upstream's multi-adapter groups are not supported)"
            )
        if self._state is not None:
            raise ValueError("add adapters before the first forward/step (the state is built then)")
        if not is_trainable:
            raise ValueError("is_trainable=False is not supported: an added adapter trains")
        g.gradient_accumulation_steps = self._gas(g, gradient_accumulation_steps)
        if isinstance(config_or_dir, str | os.PathLike):
            path = _adapter_dir(config_or_dir)
            config = LoraConfig.from_pretrained(path)
            config.inference_mode = False
            self._model = tf.lora.add_lora(self._model, config, adapter_name)
            trainable = {n: p for n, p in self._model.module.named_parameters() if p.requires_grad}
            _core_ops.load_weights(trainable, path, _core_ops.adapter_key(adapter_name))
        else:
            self._model = tf.lora.add_lora(self._model, config_or_dir, adapter_name)
        g.name = adapter_name

    # Checkpoints.
    def _tokenizer(self) -> Any:
        g = self._group
        if g.template is None and self.tokenizer_id is not None:
            try:
                self._template(g)
            except ValueError:
                return None
        return None if g.template is None else g.template.tokenizer

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
        state = self._ensure_state()
        steps = int(state.step)
        if steps % interval:
            return None
        path = Path(output_dir or "output") / (name or f"checkpoint-step-{steps}")
        extra = {
            "cur_step": steps,
            "consumed_train_samples": consumed_train_samples,
            "gradient_accumulation_steps": g.gradient_accumulation_steps,
        }
        tokenizer = self._tokenizer()
        if not g.name:
            tf.checkpoint.save(state, path, tokenizer=tokenizer, extra=extra)
            return str(path)
        tf.lora.save_adapter(state, path)
        if save_optimizer:
            tf.checkpoint.save(state, path / TRAIN_STATE_DIR, extra=extra)
        if tokenizer is not None and current_rank() == 0:
            tokenizer.save_pretrained(path)
        return str(path)

    def _checkpoint_dir(self, name: str | os.PathLike[str], output_dir: Any) -> Path:
        path = Path(name) if output_dir is None else Path(output_dir) / name
        if output_dir is None and not path.is_dir():
            path = Path("output") / name
        if not path.is_dir():
            raise ValueError(f"checkpoint directory {path} does not exist")
        return path

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
        path = self._checkpoint_dir(name, output_dir)
        state = self._ensure_state()
        if load_optimizer:
            self._state = tf.checkpoint.load(state, path / TRAIN_STATE_DIR if g.name else path)
        else:
            rename = _core_ops.adapter_key(g.name) if g.name else str
            _core_ops.load_weights(state.params, path, rename)

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
        path = self._checkpoint_dir(checkpoint_dir, None)
        self.load(path, load_optimizer=not resume_only_model, adapter_name=adapter_name)
        train_state = path / TRAIN_STATE_DIR if g.name else path
        if not tf.checkpoint.is_complete(train_state):
            raise ValueError(f"{path} has no training state; save it with save_optimizer=True")
        extra = tf.checkpoint.read_extra(train_state)
        g.gradient_accumulation_steps = extra["gradient_accumulation_steps"]
        return {
            "cur_step": extra["cur_step"],
            "consumed_train_samples": extra["consumed_train_samples"],
            "gradient_accumulation_steps": extra["gradient_accumulation_steps"],
        }

    @remote_function(collect="first")
    def get_state_dict(self, adapter_name: str | None = None) -> dict[str, torch.Tensor]:
        """The trainable parameters (the adapter's, with one) as whole tensors, by module name.
        A collective on several ranks."""
        self._resolve(adapter_name)
        return tf.unshard(self._ensure_state())

    @remote_function(execute="first")
    def get_train_configs(self, adapter_name: str | None = None) -> str:
        """A readable summary of how this model trains."""
        g = self._resolve(adapter_name)
        opt = g.optimizer
        sched = "constant lr" if g.scheduler is None else f"{g.scheduler[0]}({g.scheduler[1]})"
        processor = g.processor
        lines = [
            f"model: {self.model_id or type(self.model).__name__} ({self._model.family})",
            f"device_mesh: {self.device_mesh}",
            f"mixed_precision: {self.mixed_precision}, strategy: {self.strategy} (FSDP2 core)",
            f"adapter: {g.name or 'none (full parameters)'}",
            f"optimizer: {opt.name}(lr={opt.lr}, {opt.kwargs})",
            f"lr_scheduler: {sched}",
            f"gradient_accumulation_steps: {g.gradient_accumulation_steps}",
            "loss: CrossEntropyLoss (token mean over every micro-batch and data rank)",
            f"processor: padding_free={processor.padding_free if processor else False}",
        ]
        return "\n".join(lines)


def _check_options(
    model_cls: Any,
    mixed_precision: str,
    strategy: str,
    ddp_config: Mapping[str, Any] | None,
    grad_scaler_config: Mapping[str, Any] | None,
) -> None:
    name = model_cls if isinstance(model_cls, str) else getattr(model_cls, "__name__", "")
    if not name.endswith("ForCausalLM"):
        raise ValueError(
            f"model_cls={model_cls!r}: this build trains causal LMs; use AutoModelForCausalLM"
        )
    if mixed_precision not in PRECISIONS:
        raise ValueError(
            f"mixed_precision must be one of {', '.join(PRECISIONS)}, got {mixed_precision!r}"
        )
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if ddp_config:
        raise ValueError(
            f"ddp_config {dict(ddp_config)} is not supported: data parallelism is FSDP2 "
            "replication through the core"
        )
    if grad_scaler_config:
        raise ValueError(
            "grad_scaler_config is not supported: the core keeps float32 master weights and "
            "sums losses in float32; use mixed_precision='bf16'"
        )


def _check_norm_type(norm_type: float) -> None:
    if norm_type != 2:
        raise ValueError(f"norm_type={norm_type}: gradient clipping is by the L2 norm only")


def _override(config: PretrainedConfig, fields: Mapping[str, Any]) -> PretrainedConfig:
    """A copy of `config` with `fields` set. Raises ``ValueError`` for an unknown field."""
    unknown = [k for k in fields if not hasattr(config, k)]
    if unknown:
        raise ValueError(
            f"unknown TransformersModel arguments {unknown}: neither constructor options nor "
            f"fields of {type(config).__name__}"
        )
    config = type(config).from_dict(config.to_dict())
    for key, value in fields.items():
        setattr(config, key, value)
    return config


def _adapter_dir(path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    if not (path / "adapter_config.json").is_file():
        raise ValueError(
            f"{path} is not a peft adapter directory (no adapter_config.json); pass a "
            "LoraConfig or a directory written by save()"
        )
    return path
