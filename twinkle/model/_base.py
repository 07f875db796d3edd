"""`TrainableModel`: what `TransformersModel` and `MegatronModel` share.

Both keep their optimizer groups in `_group.Groups` (the full model ``''``, or LoRA adapters),
each with a train state and pending gradients, and train through the same calls: a group's
update comes once exactly ``gradient_accumulation_steps`` micro-batches are pending; metrics,
checkpoints, templates and processors work the same way. A subclass says how it differs:

- ``_ensure_state(g)`` builds (or brings back) group `g`'s train state, ``_update(g)`` makes
  one update from its pending gradients, ``_transform(g)`` is the optimizer its settings give
  (`_renew_optimizer` puts a new one into a built state);
- ``_check_clip`` refuses the clipping it does not do (base: a norm other than L2);
- ``_REFUSED`` names the features it refuses and why (`_check_supported`, the one place each
  is refused); ``_built`` says when the states exist (adapters come before; an optimizer
  chosen after is put in by `_renew_optimizer`);
- ``_config_lines`` adds its own lines to `get_train_configs`.

The ``remote_function`` policies recorded here hold for the subclasses (the Ray engine finds
inherited methods too); the subclasses carry ``remote_class``. The checkpoint and weight-export
calls (``save``, ``load``, ``send_weights``...) are written in `twinkle.model._weights_io` and
bound in the class body, so that they too are the base's own methods.
"""

from __future__ import annotations

import abc
import numbers
import os
from collections.abc import Mapping
from typing import Any, ClassVar

from peft import LoraConfig

import twinkle_fn as tf
from twinkle.device_mesh import DeviceMesh
from twinkle.infra import remote_function, settings
from twinkle.model import _build, _checkpoint, _group, _inputs, _weights_io, optim
from twinkle.model._inputs import Batch
from twinkle.processor import InputProcessor
from twinkle_fn.optim import GradientTransformation


class TrainableModel(abc.ABC):
    """The training calls, settings and checkpoints that both model classes share."""

    # Feature -> why this class refuses it, for `_check_supported`: ``second_adapter``,
    # ``adapter_dir`` (continuing an adapter from a peft directory), ``adapter_load`` (an
    # adapter's weights alone).
    _REFUSED: ClassVar[Mapping[str, str]] = {}

    def __init__(
        self,
        model_id: str | os.PathLike[str] | None,
        device_mesh: DeviceMesh | None,
        mixed_precision: str,
        kwargs: dict[str, Any],
        optimizer: optim.OptimizerSpec | None = None,
    ) -> None:
        """The shared setup: checks `mixed_precision`, joins the world of `device_mesh` (see
        `_build.device_mesh`), pops ``tokenizer_id``, ``seed`` and ``enable_router_replay`` (upstream's
        switch; replay needs none here) from `kwargs`, and starts
        the full-model group (with `optimizer`, default AdamW). Raises ``ValueError`` for an
        unknown precision and a mesh that does not match the world."""
        _build.check_precision(mixed_precision)
        self.device_mesh = _build.device_mesh(device_mesh)
        self.mixed_precision = mixed_precision
        self.model_id = None if model_id is None else os.fspath(model_id)
        self.tokenizer_id = kwargs.pop("tokenizer_id", self.model_id)
        self._seed = kwargs.pop("seed", settings().seed)
        # upstream's switch for routing replay: the core replays whenever asked, so nothing to do
        kwargs.pop("enable_router_replay", None)
        group = _group.Group(processor=InputProcessor(self.device_mesh))
        if optimizer is not None:
            group.optimizer = optimizer
        self._groups = _group.Groups(group)

    # What a subclass supplies.
    @abc.abstractmethod
    def _ensure_state(self, g: _group.Group) -> tf.TrainState:
        """Group `g`'s train state, built (or brought back) first if needed."""

    @abc.abstractmethod
    def _update(self, g: _group.Group) -> None:
        """One update of group `g` from its pending gradients (clipped to ``g.pending.clip``
        where the class clips itself); records ``g.pending.last_step``."""

    @abc.abstractmethod
    def _transform(self, g: _group.Group) -> GradientTransformation:
        """The optimizer transform of group `g`'s settings (optimizer and lr schedule)."""

    @abc.abstractmethod
    def _config_lines(self) -> list[str]:
        """This class's own lines of `get_train_configs`."""

    def _built(self) -> bool:
        """Whether the train states exist (adapters can no longer be added then)."""
        return self._groups.built

    def _check_clip(self, g: _group.Group, max_grad_norm: float, norm_type: float) -> None:
        """Raises ``ValueError`` for a clipping this class does not do: a norm other than L2,
        a `max_grad_norm` that is not a positive number (inf: no clipping)."""
        if norm_type != 2:
            raise ValueError(f"norm_type={norm_type}: gradient clipping is by the L2 norm only")
        positive = isinstance(max_grad_norm, numbers.Real) and not isinstance(max_grad_norm, bool)
        if not positive or not max_grad_norm > 0:
            raise ValueError(
                f"max_grad_norm must be a positive number, got {max_grad_norm!r}; pass e.g. "
                "max_grad_norm=1.0, or math.inf not to clip"
            )

    def _check_supported(self, feature: str, context: str) -> None:
        """Raises ``ValueError`` (`context`, then why) when this class refuses `feature`."""
        why = self._REFUSED.get(feature)
        if why is not None:
            raise ValueError(f"{context}: {why}")

    def _renew_optimizer(self, g: _group.Group) -> None:
        """Once group `g`'s state is built (by a forward, or an update): give it a new
        optimizer from its settings (`_transform`), with a fresh optimizer state (moments at
        zero, the schedule counted from this point) over its current weights. Before that,
        nothing: the state is built with the settings when first needed."""
        if not self._built():
            return
        state = self._ensure_state(g)
        tx = self._transform(g)
        g.state = state.replace(tx=tx, opt_state=tx.init(state.params))

    def _check_unbuilt(self, what: str) -> None:
        """Raises ``ValueError`` once the train states are built: `what` must come first."""
        if self._built():
            raise ValueError(
                f"{what} must be called before the first forward_backward (or forward): the "
                "train state and its optimizer are built then"
            )

    # Groups and states.
    @property
    def state(self) -> tf.TrainState:
        """The current `twinkle_fn.TrainState` of the default group (the last adapter added;
        built on first access, a collective on several ranks). `state_of` gives another
        adapter's."""
        return self._ensure_state(self._resolve(None))

    @property
    def optimizer_group(self) -> dict[str, _group.GroupView]:
        """Upstream's optimizer groups by adapter name (``''``: the full model while no
        adapter trains), each read live: ``model.optimizer_group['default'].cur_step``."""
        return {g.name: _group.GroupView(g) for g in self._groups}

    def state_of(self, adapter_name: str | None = None) -> tf.TrainState:
        """The current `twinkle_fn.TrainState` of adapter `adapter_name` (its weights,
        optimizer state and step). Raises ``ValueError`` for an unknown adapter."""
        return self._ensure_state(self._resolve(adapter_name))

    def _resolve(self, adapter_name: str | None) -> _group.Group:
        return self._groups.resolve(adapter_name)

    def _encode(
        self, adapter_name: str | None, inputs: Any, loss_inputs: Mapping[str, Any] | None = None
    ) -> tuple[_group.Group, Batch]:
        g = self._resolve(adapter_name)
        return g, _inputs.encode(g, self.tokenizer_id, inputs, loss_inputs, self.device_mesh)

    def _due(self, g: _group.Group, gradient_accumulation_steps: int | None) -> bool:
        """Whether group `g`'s pending gradients hold (at least) the micro-batches of one step
        (`gradient_accumulation_steps`, default the group's)."""
        return g.pending.due(_group.accumulation_steps(g, gradient_accumulation_steps))

    # Step-side calls.
    @remote_function(dispatch="all")
    def clip_grad_and_step(
        self,
        max_grad_norm: float = 1.0,
        norm_type: float = 2,
        adapter_name: str | None = None,
        gradient_accumulation_steps: int | None = None,
    ) -> float | None:
        """`clip_grad_norm`, `step`, `zero_grad`, `lr_step` after exactly
        `gradient_accumulation_steps` micro-batches (default: the group's): one update from
        the gradients clipped to `max_grad_norm`; returns their global norm before clipping,
        or None while still accumulating. Raises ``ValueError`` for a clipping the class does
        not do (a norm other than L2; on `MegatronModel` a `max_grad_norm` other than its
        optimizer's ``clip_grad``), checked on every call, for a bad
        `gradient_accumulation_steps`, and when no micro-batch was accumulated since the last
        step or ``zero_grad`` (a call after an update that consumed them returns None)."""
        g = self._resolve(adapter_name)
        self._check_clip(g, max_grad_norm, norm_type)
        g.pending.check_any("clip_grad_and_step")
        if not self._due(g, gradient_accumulation_steps):
            return None
        g.pending.clip = max_grad_norm
        self._update(g)
        return float(g.pending.last_step["grad_norm"])

    @remote_function()
    def step(
        self,
        adapter_name: str | None = None,
        gradient_accumulation_steps: int | None = None,
        **kwargs: Any,
    ) -> None:
        """On a step boundary (exactly `gradient_accumulation_steps` micro-batches pending,
        not yet consumed by an update): one optimizer update from the pending gradients,
        normalised by all their tokens; otherwise nothing (also after an update that consumed
        them, as `MegatronModel.clip_grad_norm` makes). Raises ``ValueError`` for options such
        as ``optim_params`` (set them with `set_optimizer`), for a bad
        `gradient_accumulation_steps`, and when no micro-batch was accumulated since the last
        step or ``zero_grad`` (upstream's torch optimizer would skip the update silently)."""
        if kwargs:
            raise ValueError(
                f"step() options {sorted(kwargs)} are not supported; call set_optimizer(...) "
                "to change the learning rate or weight decay"
            )
        g = self._resolve(adapter_name)
        g.pending.check_any("step")
        if self._due(g, gradient_accumulation_steps):
            self._update(g)

    @remote_function()
    def zero_grad(
        self,
        adapter_name: str | None = None,
        gradient_accumulation_steps: int | None = None,
        set_to_none: bool = True,
    ) -> None:
        """On a step boundary, drop the pending gradients (after an update there are none)."""
        g = self._resolve(adapter_name)
        if self._due(g, gradient_accumulation_steps):
            g.pending.clear()

    @remote_function()
    def lr_step(
        self, adapter_name: str | None = None, gradient_accumulation_steps: int | None = None
    ) -> None:
        """Nothing to do: the schedule is a function of the update count, so each update
        already moves the learning rate on (as a torch scheduler stepped after it would).
        Raises ``ValueError`` for a bad `gradient_accumulation_steps`."""
        _group.accumulation_steps(self._resolve(adapter_name), gradient_accumulation_steps)

    @remote_function(collect="first")
    def calculate_metric(self, is_training: bool = True, adapter_name: str | None = None) -> dict:
        """Training: the last step's ``loss`` (token mean over its micro-batches and data
        ranks), ``grad_norm``, ``lr``, ``num_tokens`` and ``step``. Evaluation: the token-mean
        ``loss`` and ``num_tokens`` of the `forward_only` calls since the last call (then
        reset), over every data rank: every rank gets the same numbers, as upstream's. Then
        the numbers of the metrics `add_metric` attached for that kind. The evaluation call
        (and a metric that gathers) is a collective: every rank calls it."""
        g = self._resolve(adapter_name)
        base = g.pending.metrics() if is_training else _group.pop_eval(g, self.device_mesh)
        return {**base, **_group.calculate_metrics(g, is_training)}

    @remote_function()
    def add_metric(self, metric_cls: Any, is_training: bool | None = None, **kwargs: Any) -> None:
        """Attach a metric to the training forwards (`is_training` True), the evaluation
        forwards (False) or both (None), as upstream's ``add_metric``: `metric_cls` is a
        `twinkle.metric.Metric` subclass (built with the model's ``device_mesh`` and `kwargs`,
        ``adapter_name`` popped first: the group it watches) or instance. Its ``calculate()``
        joins ``calculate_metric``'s dict. Raises ``ValueError`` for a metric name (upstream's
        metric classes are not provided: `twinkle.metric.NOT_PROVIDED` says why) and
        ``TypeError`` as `twinkle.metric.make_metric` does."""
        g = self._resolve(kwargs.pop("adapter_name", None))
        _group.add_metric(g, metric_cls, is_training, kwargs, self.device_mesh)

    # Settings.
    @remote_function()
    def set_loss(self, loss_cls: Any, **kwargs: Any) -> None:
        """Train with the loss `loss_cls`: a `twinkle.loss` class, instance or name (class name
        or upstream's short name), built with `kwargs`, e.g. ``set_loss('GRPOLoss',
        epsilon=0.2, beta=0.04)``. The cross entropy (the default) keeps the fused kernel; a
        policy loss then reads ``advantages`` / ``old_logps`` / ``ref_logps`` given to
        ``forward_backward``. Raises ``ValueError`` for an unknown or unavailable loss (saying
        why), arguments it refuses, or an ``ignore_index`` other than -100."""
        g = self._resolve(kwargs.pop("adapter_name", None))
        g.loss = _group.model_loss(loss_cls, kwargs)

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

    @remote_function(execute="all", sync=True)
    def add_adapter_to_model(
        self,
        adapter_name: str,
        config_or_dir: LoraConfig | Mapping[str, Any] | str | os.PathLike[str],
        is_trainable: bool = True,
        gradient_accumulation_steps: int = 1,
    ) -> None:
        """Add LoRA adapter `adapter_name` (a ``LoraConfig``, its fields as a dict, or a peft
        adapter directory to continue from) as a new optimizer group, the default one from now
        on (calls without ``adapter_name`` use it). Call it before the first forward_backward.

        The group starts with the settings made before the first adapter was added
        (optimizer, scheduler, template, processor); change them per adapter with
        ``adapter_name=``. Raises ``ValueError`` for what the class refuses (`_REFUSED`: on
        `MegatronModel` a second adapter and a directory), an empty or taken name, a call
        after the states are built, ``is_trainable=False``, a bad
        `gradient_accumulation_steps`, and what `twinkle_fn.lora.add_lora` rejects.
        """
        if self._groups.adapter_names:
            trains = f"this model already trains adapter {self._groups.adapter_names[-1]!r}"
            self._check_supported("second_adapter", trains)
        if isinstance(config_or_dir, str | os.PathLike):
            self._check_supported("adapter_dir", f"config_or_dir={os.fspath(config_or_dir)!r}")
        g = self._groups.add(adapter_name, is_trainable, gradient_accumulation_steps)
        self._check_unbuilt("add_adapter_to_model")
        self._model = _checkpoint.add_adapter(self._model, adapter_name, config_or_dir)
        self._groups.register(g)

    # Checkpoints and weight export, defined in `_weights_io`.
    save = _weights_io.save
    load = _weights_io.load
    resume_from_checkpoint = _weights_io.resume_from_checkpoint
    get_state_dict = _weights_io.get_state_dict
    weight_buckets = _weights_io.weight_buckets
    send_weights = _weights_io.send_weights

    @remote_function(execute="first")
    def get_train_configs(self, adapter_name: str | None = None) -> str:
        """A readable summary of how this model trains."""
        g = self._resolve(adapter_name)
        lines = [
            f"model: {self.model_id or 'from config'} ({self._model.family}, "
            f"{self._model.backend} backend)",
            f"device_mesh: {self.device_mesh}",
            f"mixed_precision: {self.mixed_precision}",
            *self._config_lines(),
            f"adapters: {self._groups.adapter_names or 'none'}",
            *_group.describe(g),
        ]
        return "\n".join(lines)
