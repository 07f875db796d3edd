"""`MegatronModel`: upstream Twinkle's Megatron class over the core's megatron backend.

The object holds a `TrainState` of a ``backend="megatron"`` model (built on first use; the
optimizer and scheduler may be set before or after, a later choice building a new megatron
optimizer over the current weights) and the pending `Grads` (views of megatron's DDP grad
buffers):

- ``forward_backward`` = ``tf.fwd_bwd(state, batch, accum=pending)`` (megatron's schedule runs
  forward and backward together);
- ``clip_grad_and_step`` = ``tf.step(state, pending)`` once exactly N calls are pending
  (N = ``gradient_accumulation_steps``), so the update is normalised over all their tokens.
  Upstream steps one micro-batch late; this does not.

The optimizer is always megatron-core's distributed Adam (`megatron_optimizer`) and the lr
follows ``OptimizerParamScheduler`` (`twinkle_fn.schedules.megatron`), as upstream allows.

- ``add_adapter_to_model`` = `twinkle_fn.lora.add_lora` before the state is built: one
  LoRA adapter per model (the core's megatron LoRA trains one), the model's one group;
- ``save``/``load`` = `twinkle_fn.checkpoint` (full model: megatron's dist checkpoint of model,
  optimizer, step and RNG, loadable on another tp/pp/dp mesh, plus HF safetensors) or, with an
  adapter, `twinkle_fn.lora.save_adapter` (a peft directory). A weights-only ``load``
  copies the directory's HF weights into the model through the bridge and refreshes the
  optimizer's fp32 main parameters from them.

Losses are `twinkle.loss`'s, as on `TransformersModel`: the cross entropy by default,
``set_loss('GRPOLoss', ...)`` for the core's `twinkle_fn.losses.ppo_loss`, reading the
``advantages`` / ``old_logps`` / ``ref_logps`` given to ``forward_backward``. Reference log-probs
come from the same model with its adapter off (``forward_only(disable_lora=True)``).

What both model classes share (step gating, metrics, settings, checkpoints) is in
`twinkle.model._base.TrainableModel`; what this class refuses of it is `MegatronModel._REFUSED`.
Upstream's megatron settings (optimizer, scheduler, ``ddp_config``, recompute) become the core's
in `twinkle.model._megatron_options`.
An adapter saved with ``save_optimizer=True`` carries its training state (``train_state/``, a
megatron dist checkpoint of the adapters and their optimizer state), which
``resume_from_checkpoint`` (or ``load(..., load_optimizer=True)``) restores on any mesh.
Not wired: ``forward``/``calculate_loss``/``backward`` (upstream raises too); continuing an
adapter from a peft directory and loading an adapter's weights alone: the core's megatron
backend does not read peft adapter files back yet.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch
from transformers import AutoConfig, PretrainedConfig

import twinkle_fn as tf
from twinkle.data_format import ModelOutput
from twinkle.device_mesh import DeviceMesh
from twinkle.infra import remote_class, remote_function
from twinkle.model import _accumulate, _build, _group, _inputs
from twinkle.model._base import TrainableModel
from twinkle.model._megatron_options import (
    DEFAULT_LR,
    OPTIMIZERS,
    SCHEDULERS,
    check_ddp_config,
    check_scheduler,
    model_options,
    optimizer_spec,
)
from twinkle.processor import unpack
from twinkle_fn.models.model import resolve_model_dir
from twinkle_fn.optim import GradientTransformation

# `optimizer_spec` and the accepted names are read from here too (tests, user code).
__all__ = ["DEFAULT_LR", "OPTIMIZERS", "SCHEDULERS", "MegatronModel", "optimizer_spec"]


@remote_class(execute="all")
class MegatronModel(TrainableModel):
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

    _REFUSED: ClassVar[Mapping[str, str]] = {
        "second_adapter": (
            "the megatron backend trains one LoRA adapter per model: build another "
            "MegatronModel for another adapter"
        ),
        "adapter_dir": (
            "continuing an adapter from a peft directory is not supported on MegatronModel "
            "yet; pass a LoraConfig (a new adapter), or continue it with TransformersModel"
        ),
        "adapter_load": (
            "loading adapter weights alone into MegatronModel is not supported yet; resume "
            "its training state (saved with save_optimizer=True) with load_optimizer=True or "
            "resume_from_checkpoint, or load full-model checkpoints into a MegatronModel "
            "without one"
        ),
    }

    _HEAD: ClassVar[str] = "lm"  # the core model's head (`MegatronValueModel`: "value")

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
        check_ddp_config(ddp_config)
        super().__init__(
            model_id, device_mesh, mixed_precision, kwargs, optimizer=optimizer_spec("default")
        )
        if model_id is not None and not load_weights:
            model_id, config = None, AutoConfig.from_pretrained(resolve_model_dir(model_id))
        options = model_options(
            ddp_config, recompute_granularity, recompute_method, recompute_num_layers, kwargs
        )
        self._model = _build.build_model(
            model_id,
            None if model_id is not None else config,
            {},
            mixed_precision,
            {},
            self._seed,
            backend="megatron",
            options=options,
            head=self._HEAD,
        )
        self._offload = dict(params=param_offload, grads=grad_offload, optimizer=optimizer_offload)
        self._parked: tf.Offloaded | None = None

    def _ensure_state(self, g: _group.Group) -> tf.TrainState:
        """The model's one state (`g` is its one group): brought back to the device if an
        update parked it, built on first use (a collective)."""
        if self._parked is not None:
            g.state, self._parked = tf.reload(self._parked), None
        if g.state is None:
            g.state = tf.init(
                self._model, self._transform(g), self.device_mesh.core_mesh, seed=self._seed
            )
        return g.state

    def _transform(self, g: _group.Group) -> GradientTransformation:
        return tf.optim.megatron_optimizer(_group.learning_rate(g), **g.optimizer.kwargs)

    def _built(self) -> bool:
        return self._parked is not None or super()._built()

    def _update(self, g: _group.Group) -> None:
        """One update of megatron's optimizer (it clips to its ``clip_grad``); parks the state
        in host memory if offloading is on."""
        g.state = g.pending.apply(self._ensure_state(g))
        if any(self._offload.values()):
            self._parked, g.state = tf.offload(g.state, **self._offload), None

    def _check_clip(self, g: _group.Group, max_grad_norm: float, norm_type: float) -> None:
        """Raises ``ValueError`` unless the clipping is megatron optimizer's own: by the L2
        norm to its ``clip_grad``."""
        clip = g.optimizer.kwargs.get("clip_grad", 1.0)
        if max_grad_norm != clip or norm_type != 2:
            raise ValueError(
                f"max_grad_norm={max_grad_norm}, norm_type={norm_type}: megatron's optimizer "
                f"clips by the L2 norm to its clip_grad={clip}; set it with "
                "set_optimizer('default', clip_grad=...)"
            )

    def _config_lines(self) -> list[str]:
        return [f"megatron options: {dict(self._model.options)}"]

    # Training calls.
    @remote_function(dispatch="slice_dp", collect="mean", sync=True)
    def forward_backward(
        self,
        *,
        inputs: Any,
        micro_batch_size: int | None = None,
        adapter_name: str | None = None,
        router_replay_action: Any = None,
        **loss_inputs: Any,
    ) -> ModelOutput:
        """Forward and backward on this rank's `inputs` (megatron's schedule), adding the
        gradients to the pending ones. Counts as one micro-batch of gradient accumulation.

        `inputs`: feature dicts (``input_ids``, already-shifted ``labels``), chat trajectories
        or a collated batch. `micro_batch_size`: rows per megatron run (default: the whole
        list at once, split into ``num_micro_batches`` pipeline micro-batches). `loss_inputs`:
        the per-sample data the loss of `set_loss` reads (``advantages``, ``old_logps``,
        ``ref_logps``...; as `TransformersModel.forward_backward`), attached to the samples
        before they are split into runs (so a sequence-mean loss weighs the whole call's
        sequences). Returns ``loss`` (this call's token sum over its token count on this rank,
        a float), ``num_tokens`` and ``logps`` (``[n_seq, max_len]`` per-token
        ``log p(label)`` of this rank's samples, 0 where the label is -100, as
        `TransformersModel` returns them; from the training forward itself, the same on every
        pipeline stage). Raises ``TypeError`` for a `micro_batch_size` with a collated batch,
        ``ValueError`` for a non-positive one, and before any compute as
        `TransformersModel.forward_backward` for loss inputs. `router_replay_action`: as
        `TransformersModel.forward_backward`'s.
        """
        g = self._resolve(adapter_name)
        inputs, records = _inputs.take_routing(inputs, router_replay_action, "forward_backward")
        features = _inputs.prepare(g, self.tokenizer_id, inputs, loss_inputs, self.device_mesh)
        state = self._ensure_state(g)
        loss = g.loss.token_loss()
        runs = []
        parts = _inputs.chunks(features, micro_batch_size)
        recs = [None] * len(parts) if records is None else _inputs.chunks(records, micro_batch_size)
        for i, (chunk, rec) in enumerate(zip(parts, recs, strict=True)):
            batch = _inputs.with_routing(g.processor(chunk), rec)
            runs.append((batch, g.pending.add(state, batch, counts=i == 0, loss=loss)))
        # The runs' sums add up on the device; the call's numbers are read once, here.
        totals = _accumulate.read_loss(
            sum(aux["loss_sum"] for _, aux in runs), sum(aux["num_tokens"] for _, aux in runs)
        )
        key = "values" if self._HEAD == "value" else "logps"  # what the forward yields
        rows = _stack_rows([unpack(aux[key], batch) for batch, aux in runs])
        out = ModelOutput({key: rows}, **totals)
        _group.accumulate_metrics(g, lambda: g.processor(features), out, training=True)
        return out

    @remote_function(dispatch="slice_dp", collect="mean")
    def forward_only(
        self,
        *,
        inputs: Any,
        adapter_name: str | None = None,
        disable_lora: bool = False,
        router_replay_action: Any = None,
    ) -> ModelOutput:
        """An evaluation forward (no gradient): this rank's token-mean ``loss``,
        ``num_tokens`` and ``logps`` (``[n_seq, max_len]``, as `forward_backward`), the same
        on every pipeline stage; ``calculate_metric(is_training=False)`` token-weights them
        over the data ranks. `disable_lora` computes with the base weights alone (upstream's
        reference log-probs of a LoRA model). `router_replay_action`: as
        `TransformersModel.forward_only`'s (``RECORD`` adds ``routed_experts``)."""
        action = _inputs.replay_action(router_replay_action)
        inputs, records = _inputs.take_routing(inputs, action, "forward_only")
        g, batch = self._encode(adapter_name, inputs)
        batch = _inputs.with_routing(batch, records)
        record = action == "record"
        got = tf.token_logps(
            self._ensure_state(g), batch, disable_lora=disable_lora, record_routing=record
        )
        out = ModelOutput(
            logps=unpack(got["logps"], batch),
            **_accumulate.read_loss(got["loss_sum"], got["num_tokens"]),
        )
        if record:
            out["routed_experts"] = unpack(got["routed_experts"], batch)
        _group.add_eval(g, out)
        _group.accumulate_metrics(g, lambda: batch, out, training=False)
        return out

    def get_hf_state_dict(
        self,
        adapter_name: str | None = None,
        *,
        merge_lora: bool = False,
        dtype: torch.dtype = torch.bfloat16,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Upstream's weight export for a rollout engine: ``(hf_name, tensor)`` one by one,
        whole HF-layout tensors from any mesh (a collective: every rank iterates it all).

        As upstream, adapter `adapter_name` (default: the last added) yields its factors in
        peft format (``base_model.model.<layer>.lora_A.weight``), and a model without adapters
        yields every weight (upstream's ``''``); `merge_lora` yields every weight with the
        adapter merged in instead (upstream merges the model in place around the export).
        Raises ``ValueError`` for an unknown adapter and for ``''`` once an adapter trains."""
        buckets = self.weight_buckets(adapter_name, merge_and_sync=merge_lora, dtype=dtype)
        for bucket in buckets:
            yield from bucket

    def forward(self, **kwargs: Any) -> None:
        """Not available: raises ``TypeError`` (megatron runs forward and backward together)."""
        raise TypeError(_TOGETHER.format("forward"))

    def calculate_loss(self, **kwargs: Any) -> None:
        """Not available: raises ``TypeError`` (the loss is computed inside forward_backward)."""
        raise TypeError(_TOGETHER.format("calculate_loss"))

    def backward(self, **kwargs: Any) -> None:
        """Not available: raises ``TypeError`` (megatron runs forward and backward together)."""
        raise TypeError(_TOGETHER.format("backward"))

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

    # Settings.
    @remote_function()
    def set_optimizer(self, optimizer_cls: Any, **kwargs: Any) -> None:
        """Use megatron's distributed optimizer ('default' / 'MegatronDistributedOptimizer')
        with upstream's arguments (see `optimizer_spec`). Any time: before the first forward,
        after `forward_only` calls (evaluate, or serve as a reference, before choosing), or
        between steps. A state that already exists gets a new megatron optimizer built over
        its current weights, with a fresh optimizer state (zero Adam moments, the schedule
        counted from here); the weights stay. Raises ``ValueError`` for any other optimizer,
        naming the accepted ones, and for bad values, before changing anything."""
        g = self._resolve(kwargs.pop("adapter_name", None))
        g.optimizer = optimizer_spec(optimizer_cls, **kwargs)
        self._renew_optimizer(g)

    @remote_function()
    def set_lr_scheduler(self, scheduler_cls: Any, **kwargs: Any) -> None:
        """Schedule the lr as megatron's ``OptimizerParamScheduler`` ('default' /
        'OptimizerParamScheduler'; ``lr_decay_steps``, ``lr_warmup_steps``, ``lr_decay_style``,
        ``max_lr`` (default the optimizer's lr), ``min_lr``, ...), counted in optimizer steps.
        Any time, as `set_optimizer`: megatron's optimizer holds its schedule, so on a built
        state this builds a new optimizer (fresh moments, the schedule counted from here).
        Raises ``ValueError`` for any other scheduler, naming the accepted ones, and for values
        megatron rejects, before changing anything."""
        g = self._resolve(kwargs.pop("adapter_name", None))
        check_scheduler(scheduler_cls)
        _group.set_scheduler(g, scheduler_cls, kwargs)
        self._renew_optimizer(g)


_TOGETHER = (
    "MegatronModel.{} is not available: megatron runs forward and backward together in its "
    "pipeline schedule; call forward_backward(inputs=...) (forward_only(inputs=...) to evaluate)"
)


def _stack_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[n_i, len_i]`` pieces as one ``[sum n_i, max len_i]`` tensor, zeros past each row."""
    width = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])
