"""`TransformersModel`: upstream Twinkle's stateful model class over `twinkle_fn`.

The object holds a `TrainState` (built lazily, on the first call that needs it, so adapters and
optimizer settings can be set first) and the pending `Grads`; each method calls the core:

- ``forward_backward`` = ``tf.fwd_bwd(state, batch, accum=pending)``;
- ``clip_grad_and_step`` = ``tf.step(state, pending)`` once exactly N micro-batches are pending
  (N = ``gradient_accumulation_steps``), so the update is normalised over the tokens of all N.
  Upstream steps one micro-batch late (its first sync comes at micro-batch N + 1); this does not;
- ``save``/``load`` = `twinkle_fn.checkpoint` (full model) or `twinkle_fn.lora` (adapter).

What both model classes share (step gating, metrics, settings, checkpoints) is in
`twinkle.model._base.TrainableModel`; this class adds its forward calls and the gradient norm.

Several LoRA adapters may share the model (``add_adapter_to_model`` once per name, before the
first forward): each adapter is an optimizer group with its own train state (its weights only,
its optimizer state, schedule and step), pending gradients, accumulation steps, template and
processor. A call with ``adapter_name=X`` computes with X alone active (`twinkle_fn.lora`), so
only X's weights get gradients and only X's optimizer steps; the base weights never change.
Without ``adapter_name`` a call uses the last adapter added (upstream's active group). An
adapter's ``lora_A`` init draws from torch's global generator.

Losses are `twinkle.loss`'s (``set_loss('GRPOLoss', beta=0.04)``): the cross entropy keeps the
fused lm_head kernel; a policy loss is the core's `twinkle_fn.losses.ppo_loss`, reading the
``advantages`` / ``old_logps`` / ``ref_logps`` given to ``forward_backward`` as batch fields.

Differences from upstream, by design of the core: ``forward``/``calculate_loss``/``backward`` are
kept, but the gradient comes from one ``tf.fwd_bwd`` in ``backward`` (so that path runs the
forward twice: ``forward_backward`` runs it once); log-probs and logits are computed by an extra
no-grad forward only when asked for (``return_logps=True`` / ``return_logits=True``); the lr
schedule is a function of the optimizer's update count, so ``lr_step`` has nothing left to do;
once an adapter is added, the full-parameter group ``''`` no longer trains.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

import twinkle_fn as tf
from twinkle.data_format import ModelOutput
from twinkle.device_mesh import DeviceMesh
from twinkle.infra import remote_class, remote_function
from twinkle.model import _accumulate, _build, _group, _inputs, optim
from twinkle.model._base import TrainableModel
from twinkle_fn.optim import GradientTransformation


@remote_class()
class TransformersModel(TrainableModel):
    """A transformers causal LM trained through `twinkle_fn`, with upstream Twinkle's methods.

    `model_id`: a local HF directory or ``hf://``/``ms://`` id (`tf.models.from_pretrained`);
    else `config` (an HF config) builds a random init. `model_cls` must name a causal LM (the
    core builds ``AutoModelForCausalLM``). `device_mesh` (default: the mesh of
    `twinkle.initialize`, else dp over the torch.distributed world) must match the world.
    `mixed_precision`: ``'no'``, ``'bf16'`` or ``'fp16'`` autocast over float32 master weights.
    `strategy`: ``'accelerate'`` or ``'native_fsdp'``, both FSDP2/DTensor through the core.
    `fsdp_config`: ``{"activation_checkpointing": bool, "expert_parallel": {"enabled": bool,
    "router_dtype": "fp32", "keep_router_logits": bool}}`` (upstream's; the mesh's ``ep_size``
    splits an MoE model's experts over the ep ranks, ``enabled=False`` with ``ep_size > 1`` is
    refused; EP changes the experts only, so the router's logits are transformers' either way).
    `fp8`: ``"rowwise"`` or ``"tensorwise"`` runs the decoder's linears on float8 GEMMs (the
    core's model option ``fp8``; ``mixed_precision`` stays the compute dtype);
    `fp8_store_frozen` (with `fp8`; not with tp) stores their frozen weights, a LoRA base, in float8
    too (the core's option of that name). Extra keyword arguments:
    ``tokenizer_id``, ``seed`` (random init and dropout; default the `initialize` seed),
    ``dtype``/``torch_dtype`` (parameter dtype, e.g. float64 for exact tests), and, with
    `config`, fields of the config to override. Raises ``ValueError`` for what the core does
    not do (fp8, grad scaler, DDP options, a non-causal-LM class) and for a mesh that does not
    match the world.
    """

    _HEAD: ClassVar[str] = "lm"  # the core model's head (`TransformersValueModel`: "value")

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
        fp8: str | None = None,
        fp8_store_frozen: bool = False,
        **kwargs: Any,
    ) -> None:
        fsdp_config = _build.check_options(
            model_cls, strategy, ddp_config, fsdp_config, grad_scaler_config
        )
        super().__init__(model_id, device_mesh, mixed_precision, kwargs)
        _build.check_expert_parallel(fsdp_config, self.device_mesh)
        self.strategy = strategy
        self._model = _build.build_model(
            model_id,
            config,
            kwargs,
            mixed_precision,
            fsdp_config,
            self._seed,
            options=_fp8_options(fp8, fp8_store_frozen),
            head=self._HEAD,
        )

    @property
    def model(self) -> torch.nn.Module:
        """The transformers module (sharded in place once the states are built)."""
        return self._model.module

    def _ensure_state(self, g: _group.Group) -> tf.TrainState:
        """`g`'s state; the first call builds every group's (they share the module)."""
        if g.state is None:
            mesh = self.device_mesh.core_mesh
            self._model = _group.build_states(self._model, self._groups, mesh, self._seed)
        assert g.state is not None
        return g.state

    def _update(self, g: _group.Group) -> None:
        _group.step(g)

    def _transform(self, g: _group.Group) -> GradientTransformation:
        return _group.transform(g, None)

    def _config_lines(self) -> list[str]:
        return [f"strategy: {self.strategy} (FSDP2 core)"]

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
        micro_batch_size: int | None = None,
        task: str = "causal_lm",
        router_replay_action: Any = None,
        **loss_inputs: Any,
    ) -> ModelOutput:
        """Forward and backward on this rank's `inputs`, adding the gradients to the pending ones.

        `inputs`: feature dicts (``input_ids`` and already-shifted ``labels``), chat
        trajectories (``messages``, encoded by the template) or a collated batch.
        `loss_inputs`: the per-sample data the loss of `set_loss` reads (``advantages``,
        ``old_logps``, ``ref_logps``...; one entry per sample: a number, the values of its
        supervised tokens, or a full row, see `twinkle.loss.base.align_rows`), carried with the
        samples' tokens. `micro_batch_size`: samples per forward (default all; the same
        update either way: token sums add up). Returns ``loss`` (this call's loss on this
        rank: its token sum over its token count, a float) and ``num_tokens``; with
        `return_logps` / `return_logits` also ``logps`` / ``logits`` from an extra no-grad
        forward (with the weights the gradient is taken at). `gradient_accumulation_steps` is
        read at step time (checked here: ``ValueError`` unless a positive int or None). Raises
        ``TypeError`` / ``ValueError`` before any compute for loss inputs the loss does not read,
        lacks or cannot align (naming the loss, the input and the fix), and for a bad
        `micro_batch_size` (as `MegatronModel`'s), and ``ValueError`` for a `task` other than
        upstream's ``'causal_lm'`` (the next-token loss of `set_loss`).
        `router_replay_action` ``REPLAY_FORWARD`` (upstream's ``RouterReplayAction``, or
        ``"replay_forward"``) routes an MoE model's tokens to the experts each sample's
        ``routed_experts`` (``[len, moe_layers, top_k]``, a row of `forward_only`'s record)
        lists; without it the records are ignored, as upstream.
        """
        _check_task(task)
        g = self._resolve(adapter_name)
        _group.accumulation_steps(g, gradient_accumulation_steps)
        inputs, records = _inputs.take_routing(inputs, router_replay_action, "forward_backward")
        features = _inputs.prepare(g, self.tokenizer_id, inputs, loss_inputs, self.device_mesh)
        parts = _inputs.chunks(features, micro_batch_size)
        recs = [None] * len(parts) if records is None else _inputs.chunks(records, micro_batch_size)
        runs = [_inputs.with_routing(g.processor(c), r) for c, r in zip(parts, recs, strict=True)]
        state = self._ensure_state(g)
        batch = runs[0] if len(runs) == 1 else _inputs.with_routing(g.processor(features), records)
        out = _inputs.requested_outputs(state, batch, temperature, return_logps, return_logits)
        sums = [
            g.pending.add(state, run, counts=i == 0, loss=g.loss.token_loss())
            for i, run in enumerate(runs)
        ]
        loss_sum, num_tokens = (sum(a[k] for a in sums) for k in ("loss_sum", "num_tokens"))
        out.update(_accumulate.read_loss(loss_sum, num_tokens))
        g.last = (batch, out, False)
        _group.accumulate_metrics(g, lambda: batch, out, training=True)
        return out

    @remote_function(dispatch="slice_dp", collect="flatten")
    def forward(
        self,
        *,
        inputs: Any,
        adapter_name: str | None = None,
        return_logits: bool = False,
        temperature: float = 1.0,
        **loss_inputs: Any,
    ) -> ModelOutput:
        """A training forward: returns ``logps`` (and ``logits`` if asked); `backward` then
        takes the gradient of these inputs (with `loss_inputs`, as `forward_backward`'s) under
        the group's loss. No gradient is kept from this call itself."""
        g, batch = self._encode(adapter_name, inputs, loss_inputs)
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
        router_replay_action: Any = None,
    ) -> ModelOutput:
        """An evaluation forward (no gradient): ``logps``, ``loss``, ``num_tokens`` (and
        ``logits`` if asked). `disable_lora` uses the base weights (reference log-probs).
        `router_replay_action` ``RECORD`` also returns an MoE model's ``routed_experts``
        ``[n_seq, max_len, moe_layers, top_k]`` (each token's experts per MoE layer, for a later
        ``forward_backward(..., router_replay_action=REPLAY_FORWARD)``); ``REPLAY_FORWARD``
        routes by the samples' ``routed_experts``."""
        action = _inputs.replay_action(router_replay_action)
        inputs, records = _inputs.take_routing(inputs, action, "forward_only")
        g, batch = self._encode(adapter_name, inputs)
        batch = _inputs.with_routing(batch, records)
        state = self._ensure_state(g)
        out = _inputs.outputs(
            state,
            batch,
            temperature,
            return_logits,
            disable_lora,
            record_routing=action == "record",
        )
        g.last = (batch, out, False)
        _group.add_eval(g, out)
        _group.accumulate_metrics(g, lambda: batch, out, training=False)
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
        _group.accumulation_steps(g, gradient_accumulation_steps)
        if g.last is None or not g.last[2]:
            raise ValueError("backward needs a forward(inputs=...) call before it")
        g.pending.add(self._ensure_state(g), g.last[0], loss=g.loss.token_loss())
        g.last = (g.last[0], g.last[1], False)
        _group.accumulate_metrics(g, lambda: g.last[0], g.last[1], training=True)

    @remote_function()
    def clip_grad_norm(
        self,
        max_grad_norm: float = 1.0,
        norm_type: float = 2,
        adapter_name: str | None = None,
        gradient_accumulation_steps: int | None = None,
    ) -> float | None:
        """On a step boundary: clip the coming step's gradients to `max_grad_norm` and return
        their global L2 norm before clipping (of the token-normalised gradients, any fp16 loss
        scale divided out: the ``grad_norm`` the step reports); None while micro-batches are
        still accumulating. Raises ``ValueError`` for norm_type != 2.
        """
        g = self._resolve(adapter_name)
        self._check_clip(g, max_grad_norm, norm_type)
        if not self._due(g, gradient_accumulation_steps):
            return None
        g.pending.clip = max_grad_norm
        return g.pending.grad_norm(self._ensure_state(g))

    # Settings.
    @remote_function()
    def set_optimizer(self, optimizer_cls: Any, **kwargs: Any) -> None:
        """Use optimizer `optimizer_cls` ('AdamW', 'default' = AdamW, 'Adam', 'SGD', 'Muon', or
        those torch classes, e.g. ``torch.optim.Muon`` with ``adjust_lr_fn=``) with torch's
        keyword arguments (default lr 1e-5, weight_decay 0.01 on matrices). Any time: before the first forward, or after forwards and steps (to
        evaluate first, or to change optimizers between steps). A state that already exists
        gets the new optimizer with a fresh optimizer state (zero moments, the schedule
        counted from here), as upstream's new torch optimizer; the weights stay. Raises
        ``ValueError`` for an unknown optimizer (listing the known ones) and bad values, before
        changing anything."""
        g = self._resolve(kwargs.pop("adapter_name", None))
        g.optimizer = optim.optimizer_spec(optimizer_cls, **kwargs)
        self._renew_optimizer(g)

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


# upstream's other forward tasks -> why this build has no such task
_OTHER_TASKS = {
    "fused_lm_ce": "Liger's fused linear cross entropy (--enable-liger); the core's cross "
    "entropy is already fused with the lm_head, under task='causal_lm'",
}


def _check_task(task: str) -> None:
    """Raises ``ValueError`` for a forward task other than ``'causal_lm'``, naming it."""
    if task == "causal_lm":
        return
    why = _OTHER_TASKS.get(task, "not a task of this build")
    raise ValueError(
        f"forward_backward(task={task!r}): {why}; pass task='causal_lm' (the loss set by "
        "set_loss on the next-token labels)"
    )


def _fp8_options(fp8: str | None, store_frozen: bool) -> dict[str, Any] | None:
    """The core model options `TransformersModel`'s `fp8` and `fp8_store_frozen` set (None for
    none; the backend checks their values when it builds the first state)."""
    options: dict[str, Any] = {} if fp8 is None else {"fp8": fp8}
    if store_frozen:
        options["fp8_store_frozen"] = store_frozen
    return options or None
