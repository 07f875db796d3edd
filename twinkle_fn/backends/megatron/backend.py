"""The megatron backend: HF model families trained on megatron-core's ``GPTModel``.

Hybrid families (Qwen3.5's Gated DeltaNet layers) are ``GPTModel`` too, megatron's
``GatedDeltaNet`` as those layers' attention, not ``HybridModel``: why is in
`twinkle_fn.backends.megatron.model`. Without fla (flash-linear-attention) the DeltaNet runs on
torch kernels (`twinkle_fn.backends.megatron.gated_delta_net`), on the CPU and on GPUs.

`MegatronBackend.prepare` builds this rank's pipeline stage from the model's HF config over
megatron-core's process groups (`twinkle_fn.backends.megatron.parallel`), loads this rank's slices of the
HF weights through the bridge, wraps the stage in ``Float16Module`` (bf16 / fp16) and megatron's
``DistributedDataParallel`` (fp32 grad buffers, the distributed optimizer's layout).
`fwd_bwd` runs megatron-core's schedule (`twinkle_fn.backends.megatron.train`): gradients are token sums
in the DDP grad buffers, and the returned `Grads` are views of them. By default the DDP reduces
them over data x context-parallel ranks bucket by bucket during the backward of each call's last
micro-batch (`twinkle_fn.backends.megatron.grad_sync`, exact across accumulating calls); `step` then
finishes the reduction (sequence-parallel norms, tied embeddings across stages), divides by the
global supervised-token count, and applies the optimizer. With ``overlap_grad_reduce=False``
the buffers hold this rank's unreduced sums until `step` reduces them all at once. Under context
parallelism each rank runs its chunks of every sequence (`twinkle_fn.backends.megatron.context_parallel`;
TransformerEngine's attention when its spec is used). A critic (``head="value"``) is the same
``GPTModel`` ending in a replicated value head (`twinkle_fn.backends.megatron.model.ValueHead`):
it trains value losses and gives `MegatronBackend.token_values`.

Optimizers. `megatron_optimizer` is the transform to use: ``tf.init`` builds megatron-core's
``DistributedOptimizer`` over the model chunks (fp32 main params, optimizer state sharded over
data-parallel ranks, clipping by the true global norm across tp / pp / ep), and the learning rate
follows a `twinkle_fn.schedules` schedule the way ``OptimizerParamScheduler`` sets it. Any other
`GradientTransformation` (``tf.optim.adamw``...) is applied to the model's own parameters, in
their own dtype (bf16 under ``precision="bf16"``: no fp32 master copy), after an all-reduce,
replicated on every data and context-parallel rank; it needs whole parameters on every rank
(tp, pp and ep of 1), since its global norm sees only local tensors.

``Model.options`` read by `prepare`: ``num_micro_batches`` (per `fwd_bwd` call; default the
pipeline size), ``vocab_multiple`` (vocabulary padding unit per tp rank; default 128),
``use_te`` (TransformerEngine's layer spec; default when importable), ``grouped_experts``
(MoE experts as grouped GEMMs, default True; False: megatron's ``SequentialMLP`` loop, same
parameters, see `twinkle_fn.backends.megatron.grouped_experts`), ``lora`` (a
``peft.LoraConfig``: train LoRA adapters only, see `twinkle_fn.backends.megatron.lora`),
``overlap_grad_reduce`` (reduce gradients during backward; default True), ``grad_bucket_size``
(gradient elements per reduction bucket; default megatron's ``max(4e7, 1e6 * dp)`` with overlap,
one bucket without), ``compile_layers`` (``True`` or a dict of ``torch.compile`` arguments
and ``memory_budget``: compile each decoder layer of this stage, as on the transformers
backend, see `twinkle_fn.backends.compile_layers`), ``fp8`` (``"rowwise"`` or ``"tensorwise"``:
the decoder's trained linears multiply in float8, see `twinkle_fn.backends.megatron.fp8_linears`;
megatron's own ``TransformerConfig.fp8`` is TransformerEngine's and not offered) and any
``TransformerConfig`` field (e.g.
``recompute_granularity``) but those the mesh, the precision and the loss decide (parallel
sizes, sequence parallelism, ``bf16`` / ``fp16``, per-token loss). A model built with
``activation_checkpointing=True`` recomputes every layer in backward (megatron's full, uniform
recompute of one layer at a time) unless the options say otherwise.

``overlap_param_gather`` (default False, as in megatron): `step` leaves the distributed
optimizer's parameter all-gathers in flight and the next forward waits for each bucket as it
reaches it (`twinkle_fn.backends.megatron.param_sync`). Until then ``state.params`` hold stale values of
the shards other data ranks updated: the library's readers (``unshard``, checkpoints, offload,
adapter export, a new optimizer's ``init``) call `MegatronBackend.settle` first, and so must
code that reads ``state.params`` directly between a `step` and the next forward.

Dropout draws from megatron-core's RNG streams, seeded once when megatron's parallel state is
initialised (seed 0); the state's ``rng`` key advances with every step but does not reseed them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from peft import LoraConfig
from torch import Tensor

from twinkle_fn.backends.megatron import (
    dist_checkpoint,
    export,
    grad_sync,
    lora,
    param_sync,
    sharding,
    weights,
)
from twinkle_fn.backends.megatron.lora_linear import adapters_off
from twinkle_fn.backends.megatron.micro_batch import merge_logps, micro_batches
from twinkle_fn.backends.megatron.optimizer import (
    MegatronOptState,
    megatron_optimizer,
    megatron_update,
)
from twinkle_fn.backends.megatron.placement import (
    PLACEMENT_ATTR,
    MegatronPlacement,
    model_placement,
    place,
)
from twinkle_fn.backends.megatron.router import RouterRun
from twinkle_fn.backends.megatron.train import forward_backward
from twinkle_fn.losses import LossOutput, TokenLoss
from twinkle_fn.mesh import Mesh
from twinkle_fn.models.families import family
from twinkle_fn.models.model import Model
from twinkle_fn.moe import ROUTED_EXPERTS, ROUTER_TOKEN, RouterLoss, router_loss, with_token_field
from twinkle_fn.optim import apply_updates, current_lr
from twinkle_fn.pytree import tree_global_norm
from twinkle_fn.state import Grads, TrainState, next_key
from twinkle_fn.tensor_specs import TensorSpec

__all__ = [
    "PLACEMENT_ATTR",
    "MegatronBackend",
    "MegatronOptState",
    "MegatronPlacement",
    "evaluate_logps",
    "megatron_optimizer",
]


class MegatronBackend:
    """`twinkle_fn.backends.base.Backend` over megatron-core (see the module docstring)."""

    reads_own_weights = True
    offers_grad_norm = False
    heads = ("lm", "value")  # a critic: `twinkle_fn.backends.megatron.model.ValueHead`

    def module_device(self) -> torch.device:
        """The CPU: the HF module only lends the ``GPTModel`` its initial weights."""
        return torch.device("cpu")

    def adopt(self, module: torch.nn.Module) -> None:
        """Nothing: megatron builds its own model from the module's config and weights."""

    def initial_loss_scale(self, model: Model, scale: float) -> None:
        """None: megatron's optimizer keeps its own loss scale."""
        return None

    def prepare(self, model: Model, mesh: Mesh) -> Model:
        """Build, load and wrap this rank's ``GPTModel`` stage for `mesh` (every rank calls it).

        Starts a one-rank process group when there is none and `mesh` has one rank, and
        megatron-core's parallel state (seed 0) unless it is already initialised for `mesh`.
        Raises ``ValueError`` for unknown options, a mesh other than the one the model or
        megatron-core is already placed on, or as ``build_gpt_model`` does; ``RuntimeError``
        without a process group on a multi-rank mesh or when the weights do not fit the model.
        """
        if model.placement is not None:
            if model.placement.mesh != mesh:
                raise ValueError(
                    f"this model is already placed on {model.placement.mesh}, not {mesh}; "
                    "build a new model for another mesh"
                )
            return model
        return dataclasses.replace(model, placement=place(model, mesh))

    def trainable(self, model: Model) -> dict[str, Tensor]:
        """This rank's ``GPTModel`` parameters with ``requires_grad``, by megatron name.

        Each carries its placement as attribute `PLACEMENT_ATTR`, which `megatron_optimizer`'s
        ``init`` reads. Raises ``ValueError`` for a model not prepared by this backend.
        """
        placement = model_placement(model)
        return {n: p for n, p in placement.module.named_parameters() if p.requires_grad}

    def loss_of(self, state: TrainState, batch: Mapping[str, Tensor]) -> LossOutput:
        """Token-summed loss and supervised-token count of `batch` (forward only, no graph).

        Runs megatron's schedule without backward; the result is the same on every pipeline
        stage. Raises ``ValueError`` as `twinkle_fn.backends.megatron.micro_batch.micro_batches` does.
        """
        out, _, _ = _forward_only(state, batch)
        return out

    def fwd_bwd(
        self,
        state: TrainState,
        batch: Mapping[str, Tensor],
        accum: Grads | None,
        loss: TokenLoss | None,
    ) -> tuple[Grads, dict[str, Tensor]]:
        """Token-sum gradients of `batch`, accumulated in the DDP grad buffers.

        `loss` None is the default cross entropy (fused at tp 1); a `TokenLoss` runs on the last
        stage over `twinkle_fn.backends.megatron.token_terms`, its batch fields carried by every
        micro-batch. Without `accum` the buffers are zeroed first; with it, `accum` must be the `Grads` that
        owns them (the latest one, donated). Returns `Grads` whose tensors are views of the
        buffers and this call's ``loss_sum`` / ``num_tokens`` and ``logps`` (per-token
        ``log p(label)`` in `batch`'s layout, see `evaluate_logps`; a critic's are ``values``,
        its per-token values before the update). The views hold this rank's
        unreduced sums with ``overlap_grad_reduce=False``; with it (the default) the sums over
        data ranks on the part of each buffer this rank's optimizer reads (its shard under
        `megatron_optimizer`, all of it under a plain transform) and scratch elsewhere.
        Raises ``ValueError`` for a stale or copied `accum`, or a malformed batch;
        ``RuntimeError`` as `twinkle_fn.backends.megatron.grad_sync.finish_backward` does.
        """
        placement = model_placement(state.model)
        params = None if accum is None else _live(placement, accum, "fwd_bwd(accum=...)")
        batch, run = _router_run(state, batch, train=True)
        fields = (() if loss is None else tuple(loss.fields)) + (
            () if run is None else (ROUTER_TOKEN,)
        )
        mbs = _micro_batches(placement, batch, fields)
        if placement.overlap_grad_reduce:
            # A plain transform reads whole gradients: all-reduce them rather than scatter.
            all_reduce = not isinstance(state.opt_state, MegatronOptState)
            grad_sync.begin_backward(
                placement.chunks, accumulate=accum is not None, all_reduce=all_reduce
            )
        elif accum is None:
            for chunk in placement.chunks:
                chunk.zero_grad_buffer()
        if params is None:
            params = {n: p.main_grad for n, p in state.params.items()}
            placement.live_grads = params
        try:
            loss_sum, num_tokens, per_token = forward_backward(
                placement.chunks,
                mbs,
                placement.hf_config.vocab_size,
                loss=loss,
                head=placement.head,
                router=run,
            )
        finally:
            routed = {} if run is None else run.end(mbs[0].labels.device)
        if placement.overlap_grad_reduce:
            grad_sync.finish_backward(placement.chunks)
        if placement.overlap_param_gather:
            param_sync.finish(placement.chunks)  # the forward waited for every gather
        key = "values" if placement.head == "value" else "logps"
        aux = {"loss_sum": loss_sum, "num_tokens": num_tokens, key: _merged(batch, mbs, per_token)}
        aux.update(routed)
        if accum is not None:
            loss_sum = accum.loss_sum + loss_sum
            num_tokens = accum.num_tokens + num_tokens
        done = 0 if accum is None else accum.num_micro_batches
        return Grads(params, loss_sum, num_tokens, num_micro_batches=done + len(mbs)), aux

    def token_logps(
        self,
        state: TrainState,
        batch: Mapping[str, Tensor],
        *,
        temperature: float,
        disable_lora: bool,
        return_logits: bool,
        record_routing: bool = False,
    ) -> dict[str, Tensor]:
        """See `evaluate_logps`; `disable_lora` computes with the base weights alone
        (`twinkle_fn.backends.megatron.lora_linear.adapters_off`). Raises ``ValueError`` for a
        temperature other than 1 or logits, which megatron's fused loss path does not give."""
        if temperature != 1.0 or return_logits:
            raise ValueError(
                "the megatron backend gives log-probs at temperature 1, without logits (asked: "
                f"temperature={temperature}, return_logits={return_logits}); use the "
                "transformers backend"
            )
        chunks = model_placement(state.model).chunks
        with adapters_off(chunks) if disable_lora else contextlib.nullcontext():
            out, logps, record = _forward_only(state, batch, record_routing=record_routing)
        result = {"logps": logps, "loss_sum": out.loss_sum, "num_tokens": out.num_tokens}
        if record is not None:
            result[ROUTED_EXPERTS] = record
        return result

    @torch.no_grad()
    def token_values(self, state: TrainState, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """A critic's per-token values of `batch`: megatron's schedule without backward, the
        values of the last stage's `twinkle_fn.backends.megatron.model.ValueHead` broadcast to
        every stage and merged back into `batch`'s layout (``[B, T]`` padded, ``[1, T]``
        packed; float32, 0 where the label is -100), the same on every pipeline stage and
        context-parallel rank of a data shard, and ``num_tokens``. A collective over the
        model's ranks. Raises ``ValueError`` as
        `twinkle_fn.backends.megatron.micro_batch.micro_batches` does."""
        placement = model_placement(state.model)
        mbs = _micro_batches(placement, batch)
        _, num_tokens, values = forward_backward(
            placement.chunks,
            mbs,
            placement.hf_config.vocab_size,
            forward_only=True,
            head=placement.head,
        )
        return {"values": _merged(batch, mbs, values), "num_tokens": num_tokens}

    def optimizer(self, lr: Any, **hyper: Any) -> Any:
        """See `twinkle_fn.backends.megatron.optimizer.megatron_optimizer`."""
        return megatron_optimizer(lr, **hyper)

    def grad_norm(self, state: TrainState, grads: Grads) -> Tensor:
        """Not offered: megatron's optimizer reduces and measures its gradients inside its
        update. Raises ``ValueError`` pointing at ``tf.step``'s ``info["grad_norm"]``."""
        raise ValueError(
            "the megatron backend measures the gradient norm inside its optimizer step; read "
            "info['grad_norm'] from tf.step (clipping is megatron_optimizer's clip_grad)"
        )

    def update(self, state: TrainState, grads: Grads) -> tuple[TrainState, dict[str, Any]]:
        """Finish reducing `grads`, divide by every data rank's tokens, apply the optimizer.

        Returns the new state and ``info`` with ``loss``, ``grad_norm`` (before clipping; NaN
        when an fp16 overflow skipped the update), ``num_tokens`` and ``lr``. Raises
        ``ValueError`` for stale grads, grads reduced for another kind of optimizer, or a
        non-megatron transform on a mesh that splits parameters.
        """
        placement = model_placement(state.model)
        _live(placement, grads, "step")
        opt = state.opt_state
        if not isinstance(opt, MegatronOptState):
            _check_whole_params(placement.mesh)
        if placement.overlap_grad_reduce and any(
            c.force_all_reduce == isinstance(opt, MegatronOptState) for c in placement.chunks
        ):
            raise ValueError(
                "these gradients were reduced for another optimizer kind (fwd_bwd ran with a "
                "state whose optimizer differs from this one's); step with the same state"
            )
        placement.live_grads = None
        totals = torch.stack([grads.loss_sum.double(), grads.num_tokens.double()])
        # Over data ranks only: fwd_bwd's totals already sum the context-parallel ranks.
        dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
        loss_sum, num_tokens = totals[0], totals[1].long()
        if isinstance(opt, MegatronOptState):
            grad_norm, opt = megatron_update(placement, opt, num_tokens)
        else:
            grad_norm, opt = _transform_update(state, placement, grads, num_tokens)
        if placement.overlap_param_gather:
            # a plain transform updated whole parameters on every rank: nothing to gather
            sync = param_sync.start if isinstance(opt, MegatronOptState) else param_sync.finish
            sync(placement.chunks)
        new = state.replace(opt_state=opt, step=state.step + 1, rng=next_key(state.rng))
        info = {
            "loss": (loss_sum / num_tokens.clamp(min=1)).float(),
            "grad_norm": grad_norm,
            "num_tokens": num_tokens,
            "lr": current_lr(opt),
        }
        return new, info

    def after_eval(self, model: Model) -> None:
        """Nothing to release: megatron's forward keeps no gathered parameters."""

    def settle(self, model: Model) -> None:
        """See `twinkle_fn.backends.megatron.weights.settle`."""
        weights.settle(model)

    def unshard(self, state: TrainState) -> dict[str, Tensor]:
        """See `twinkle_fn.backends.megatron.weights.full_weights`."""
        return weights.full_weights(state, buffers=False)

    def shard_params(
        self, full: Mapping[str, Tensor], mesh: Mesh, model: Model, rank: int
    ) -> dict[str, Tensor]:
        """See `twinkle_fn.backends.megatron.sharding.shard_params`."""
        return sharding.shard_params(full, mesh, model, rank)

    def unshard_params(
        self, pieces_by_rank: Mapping[int, Mapping[str, Tensor]], mesh: Mesh, model: Model
    ) -> dict[str, Tensor]:
        """See `twinkle_fn.backends.megatron.sharding.unshard_params`."""
        return sharding.unshard_params(pieces_by_rank, mesh, model)

    def shard_into(self, dst: Tensor, full: Tensor) -> None:
        """Copy `full` into `dst`: the megatron backend re-shards only through checkpoints, so
        every tensor the core hands it whole is whole here too."""
        with torch.no_grad():
            dst.copy_(full)

    def save(self, state: TrainState, directory: Path) -> dict[str, Any]:
        """See `twinkle_fn.backends.megatron.dist_checkpoint.save`."""
        dist_checkpoint.save(state, directory)
        return {"sharded": True}

    def hf_specs(self, state: TrainState) -> tuple[dict[str, TensorSpec], frozenset[str]]:
        """See `twinkle_fn.backends.megatron.dist_checkpoint.hf_specs`."""
        return dist_checkpoint.hf_specs(state)

    def load(self, state: TrainState, directory: Path, manifest: Mapping[str, Any]) -> TrainState:
        """See `twinkle_fn.backends.megatron.dist_checkpoint.load`."""
        return dist_checkpoint.load(state, directory)

    def load_weights(
        self, state: TrainState, directory: Path, rename: Callable[[str], str] | None
    ) -> None:
        """See `twinkle_fn.backends.megatron.dist_checkpoint.load_weights`. Raises
        ``ValueError`` for a `rename` (adapters are not read back on this backend yet) or a
        model that trains adapters."""
        if rename is not None or model_placement(state.model).lora is not None:
            raise ValueError(
                "loading adapter weights is not supported on the megatron backend yet; load "
                "full-model HF weights into a megatron model without adapters"
            )
        dist_checkpoint.load_weights(state, directory)

    def add_lora(
        self, model: Model, config: LoraConfig | Mapping[str, Any], adapter_name: str
    ) -> Model:
        """See `twinkle_fn.backends.megatron.lora.add_lora` (one adapter per model)."""
        return lora.add_lora(model, config, adapter_name)

    def adapter_names(self, model: Model) -> list[str]:
        """The model's one adapter, or none."""
        return lora.adapter_names(model)

    def set_adapter(self, model: Model, adapter_name: str) -> None:
        """Nothing to switch: the one adapter is always active. Raises ``ValueError`` for
        another name."""
        names = lora.adapter_names(model)
        if adapter_name not in names:
            have = f"adapter {names}" if names else "no LoRA adapter (add one with add_lora)"
            raise ValueError(f"adapter {adapter_name!r} does not exist; this model has {have}")

    def use_adapter(self, state: TrainState) -> None:
        """Nothing to switch: the one adapter is always active."""

    def adapter_state_dict(self, state: TrainState) -> dict[str, Tensor]:
        """See `twinkle_fn.backends.megatron.lora.adapter_state_dict`."""
        return lora.adapter_state_dict(state)

    def adapter_config(self, state: TrainState) -> LoraConfig:
        """See `twinkle_fn.backends.megatron.lora.adapter_config`."""
        return lora.adapter_config(state)

    def export_weights(
        self, state: TrainState, dtype: torch.dtype, bucket_bytes: int, lora: str
    ) -> Iterator[list[tuple[str, Tensor]]]:
        """See `twinkle_fn.backends.megatron.export.export_weights`."""
        return export.export_weights(state, dtype, bucket_bytes, lora)


@torch.no_grad()
def evaluate_logps(state: TrainState, batch: Mapping[str, Tensor]) -> tuple[LossOutput, Tensor]:
    """``tf.evaluate`` of a megatron state that also returns the per-token log-probabilities.

    Runs megatron's schedule without backward. Returns the token-summed loss and supervised
    token count, and ``logps`` float32 in `batch`'s own layout (``[B, T]`` padded, ``[1, T]``
    packed): ``log p(label)`` of each token, 0 where the label is -100, the same on every
    pipeline stage and context-parallel rank of a data shard. A collective over the model's
    ranks. Raises ``DonatedError`` for a donated state, ``ValueError`` as
    `twinkle_fn.backends.megatron.micro_batch.micro_batches` does.
    """
    state.check_alive()
    out, logps, _ = _forward_only(state, batch)
    return out, logps


@torch.no_grad()
def _forward_only(
    state: TrainState, batch: Mapping[str, Tensor], *, record_routing: bool = False
) -> tuple[LossOutput, Tensor, Tensor | None]:
    """`evaluate_logps`' results and, with `record_routing`, the routing record of an MoE
    model (`twinkle_fn.moe`); a batch's ``routed_experts`` is replayed."""
    placement = model_placement(state.model)
    batch, run = _router_run(state, batch, train=False, record_routing=record_routing)
    mbs = _micro_batches(placement, batch, () if run is None else (ROUTER_TOKEN,))
    try:
        loss_sum, num_tokens, logps = forward_backward(
            placement.chunks,
            mbs,
            placement.hf_config.vocab_size,
            forward_only=True,
            router=run,
        )
        record = run.recorded(batch) if run is not None and record_routing else None
    finally:
        if run is not None:
            run.end(mbs[0].labels.device)
    return LossOutput(loss_sum, num_tokens), _merged(batch, mbs, logps), record


def _router_run(
    state: TrainState, batch: Mapping[str, Tensor], *, train: bool, record_routing: bool = False
) -> tuple[Mapping[str, Tensor], RouterRun | None]:
    """`batch` with `twinkle_fn.moe.ROUTER_TOKEN` and the `RouterRun` of an MoE model (its
    router losses when `train`), else `batch` and None. Raises ``ValueError`` for router
    losses, replay or recording with pipeline parallelism, and as
    `twinkle_fn.moe.with_token_field` does."""
    placement = model_placement(state.model)
    config = placement.hf_config
    batch = with_token_field(config, batch)
    if family(config).moe is None:
        return batch, None
    loss = router_loss(state.model.options, config) if train else RouterLoss()
    replay = batch.get(ROUTED_EXPERTS)
    if placement.mesh.pp > 1 and (loss.active or replay is not None or record_routing):
        raise ValueError(
            f"router losses, routing replay and recording need pp=1 on the megatron backend "
            f"(the mesh has pp={placement.mesh.pp}: a micro-batch's router statistics are "
            "summed between its forward and its backward); use pp=1, or "
            "router_loss={'aux_coef': 0, 'z_coef': 0} without routed_experts"
        )
    run = RouterRun(
        placement.module,
        config,
        loss,
        record=replay,
        record_routing=record_routing,
        sequence_parallel=placement.mesh.sequence_parallel,
    )
    return batch, run


def _merged(batch: Mapping[str, Tensor], mbs: list[Any], logps: list[Tensor]) -> Tensor:
    group = parallel_state.get_context_parallel_group()
    return merge_logps(batch, mbs, logps, cp_group=group if group.size() > 1 else None)


def _micro_batches(
    placement: MegatronPlacement, batch: Mapping[str, Tensor], fields: Sequence[str] = ()
) -> list[Any]:
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    return micro_batches(
        batch,
        placement.num_micro_batches,
        seq_multiple=placement.seq_multiple,
        cp_size=placement.mesh.cp,
        cp_rank=parallel_state.get_context_parallel_rank(),
        device=device,
        fields=fields,
    )


def _live(placement: MegatronPlacement, grads: Grads, where: str) -> dict[str, Tensor]:
    if grads.params is not placement.live_grads:
        raise ValueError(
            f"{where} got gradients that no longer own megatron's grad buffers (a later fwd_bwd "
            "or step reused them, or they are a copy); pass the Grads of the latest fwd_bwd, "
            "donated (donate=True)"
        )
    return grads.params


def _check_whole_params(mesh: Mesh) -> None:
    if mesh.tp > 1 or mesh.pp > 1 or mesh.ep > 1:
        raise ValueError(
            f"a twinkle_fn.optim transform needs whole parameters on every rank, but {mesh} "
            "splits them (its global norm would see only local shards); use "
            "twinkle_fn.backends.megatron.megatron_optimizer(...)"
        )


def _transform_update(
    state: TrainState, placement: MegatronPlacement, grads: Grads, num_tokens: Tensor
) -> tuple[Tensor, Any]:
    finalize_model_grads(placement.chunks, force_all_reduce=True)
    for chunk in placement.chunks:
        chunk.scale_gradients(1.0 / num_tokens.clamp(min=1).double())
    g = {n: t.to(state.params[n].dtype) for n, t in grads.params.items()}
    grad_norm = tree_global_norm(g)
    updates, opt = state.tx.update(g, state.opt_state, state.params)
    apply_updates(state.params, updates)
    return grad_norm, opt
