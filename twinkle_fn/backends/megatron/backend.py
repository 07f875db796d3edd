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
megatron's own ``TransformerConfig.fp8`` is TransformerEngine's and not offered),
``fp8_store_frozen`` (with ``fp8``: the frozen LoRA bases stored in float8) and any
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

`MegatronBackend` runs the forward and backward in `twinkle_fn.backends.megatron.compute` and
the optimizer step in `twinkle_fn.backends.megatron.step`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig
from torch import Tensor

from twinkle_fn.backends.megatron import (
    compute,
    dist_checkpoint,
    export,
    lora,
    sharding,
    step,
    weights,
)
from twinkle_fn.backends.megatron.compute import evaluate_logps
from twinkle_fn.backends.megatron.optimizer import MegatronOptState, megatron_optimizer
from twinkle_fn.backends.megatron.placement import (
    PLACEMENT_ATTR,
    MegatronPlacement,
    model_placement,
    place,
)
from twinkle_fn.losses import LossOutput, TokenLoss
from twinkle_fn.mesh import Mesh
from twinkle_fn.models.model import Model
from twinkle_fn.state import Grads, TrainState
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
        """See `twinkle_fn.backends.megatron.compute.loss_of`."""
        return compute.loss_of(state, batch)

    def fwd_bwd(
        self,
        state: TrainState,
        batch: Mapping[str, Tensor],
        accum: Grads | None,
        loss: TokenLoss | None,
    ) -> tuple[Grads, dict[str, Tensor]]:
        """See `twinkle_fn.backends.megatron.compute.fwd_bwd`."""
        return compute.fwd_bwd(state, batch, accum, loss)

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
        """See `twinkle_fn.backends.megatron.compute.token_logps`."""
        return compute.token_logps(
            state,
            batch,
            temperature=temperature,
            disable_lora=disable_lora,
            return_logits=return_logits,
            record_routing=record_routing,
        )

    def token_values(self, state: TrainState, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """See `twinkle_fn.backends.megatron.compute.token_values`."""
        return compute.token_values(state, batch)

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
        """See `twinkle_fn.backends.megatron.step.update`."""
        return step.update(state, grads)

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
