"""The transformers backend: an HF module, sharded by FSDP2/DTensor on several ranks."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from peft import LoraConfig

from twinkle_fn.backends.transformers import (
    attention,
    checkpoint,
    compute,
    export,
    fp8_linears,
    fsdp,
    linear_attention,
    logps,
    lora,
    sharding,
)
from twinkle_fn.backends.transformers.lm_head import fuse_lm_head
from twinkle_fn.backends.transformers.loss_scale import LossScale, init_loss_scale, next_loss_scale
from twinkle_fn.data import IGNORE_INDEX
from twinkle_fn.losses import LossOutput, TokenLoss
from twinkle_fn.mesh import Mesh
from twinkle_fn.models.model import Model
from twinkle_fn.optim import (
    GradientTransformation,
    adamw,
    apply_updates,
    chain,
    clip_by_global_norm,
    current_lr,
)
from twinkle_fn.optim.base import ScaledUpdates, foreach_mul_, materialise, pending_scale
from twinkle_fn.pytree import tree_global_norm
from twinkle_fn.state import Grads, TrainState, next_key
from twinkle_fn.tensor_specs import TensorSpec


class TransformersBackend:
    """`twinkle_fn.backends.base.Backend` over `compute` and `fsdp` (placement)."""

    reads_own_weights = False
    offers_grad_norm = True
    heads = ("lm", "value")

    def module_device(self) -> torch.device:
        """The GPU when there is one, else the CPU."""
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

    def adopt(self, module: torch.nn.Module) -> None:
        """Turn the lm_head into a `FusedLMHead` (the loss is fused into it); a value model
        (no output embeddings, a ``score`` head) is left as it is. Linear-attention layers keep
        packed samples apart (`linear_attention.keep_samples_apart`)."""
        if module.get_output_embeddings() is not None:
            fuse_lm_head(module)
        linear_attention.keep_samples_apart(module)

    def prepare(self, model: Model, mesh: Mesh) -> Model:
        """Shard the module over `mesh` (tp plan, then FSDP2) unless it already is.

        ``Model.options["compile_layers"]``: ``True`` or a dict of ``torch.compile`` arguments
        (and ``memory_budget``, see `twinkle_fn.backends.compile_layers`) compiles each decoder
        layer (after the tp plan, before FSDP2 wraps it), fusing the norms, rotary embedding,
        SwiGLU and residual adds that eager mode runs one by one.
        The residual stream runs in the compute dtype on any mesh (`compute.cast_residual_stream`),
        and frozen weight matrices (a LoRA model's base) are stored in it
        (`lora.store_frozen_in`); trained parameters stay float32 master weights unless
        ``Model.options["master_weights"]`` is ``False`` (every parameter in the compute dtype,
        for `twinkle_fn.optim.adamw_bf16`).
        A module on transformers' SDPA attention switches to `attention.NAME`, which runs
        packed rows on a varlen kernel. ``Model.options["fp8"]`` (``"rowwise"`` or
        ``"tensorwise"``) runs the decoder's trained linears on float8 GEMMs
        (`fp8_linears.use_fp8_linears`, before the tp plan, compilation and FSDP2);
        ``Model.options["fp8_store_frozen"]`` stores their frozen weights in float8 too.
        """
        if model.placement is not None:
            return model
        compute.cast_residual_stream(model.module)
        lora.store_frozen_in(model.module, model.compute_dtype, _master_weights(model))
        attention.use_varlen_attention(model.module)
        fp8_linears.use_fp8_linears(model, mesh)
        if mesh.world_size == 1:
            fsdp.compile_layers(model)
            return model
        return fsdp.parallelize(model, mesh)

    def trainable(self, model: Model) -> dict[str, torch.Tensor]:
        """The module's parameters with ``requires_grad``."""
        return {n: p for n, p in model.module.named_parameters() if p.requires_grad}

    def initial_loss_scale(self, model: Model, scale: float) -> LossScale | None:
        """A dynamic loss scale starting at `scale` when the model computes in float16."""
        return init_loss_scale(scale) if model.compute_dtype == torch.float16 else None

    def loss_of(self, state: TrainState, batch: Mapping[str, torch.Tensor]) -> LossOutput:
        """See `twinkle_fn.backends.transformers.compute.loss_of`; under ulysses, summed over the
        group (each rank computed its slice of the batch)."""
        out = compute.loss_of(state, batch)
        group = _ulysses_group(state)
        if group is None:
            return out
        sums = torch.stack([out.loss_sum.double(), out.num_tokens.double()])
        dist.all_reduce(sums, group=group)
        return LossOutput(sums[0].to(out.loss_sum.dtype), sums[1].to(out.num_tokens.dtype))

    def fwd_bwd(
        self,
        state: TrainState,
        batch: Mapping[str, torch.Tensor],
        accum: Grads | None,
        loss: TokenLoss | None,
    ) -> tuple[Grads, dict[str, torch.Tensor]]:
        """See `twinkle_fn.backends.transformers.compute.fwd_bwd`."""
        return compute.fwd_bwd(state, batch, accum, loss)

    def token_logps(
        self,
        state: TrainState,
        batch: Mapping[str, torch.Tensor],
        *,
        temperature: float,
        disable_lora: bool,
        return_logits: bool,
        record_routing: bool = False,
    ) -> dict[str, torch.Tensor]:
        """See `twinkle_fn.backends.transformers.logps.token_logps`. Raises ``ValueError``
        under ulysses."""
        _refuse_ulysses(state, "tf.token_logps")
        out = logps.token_logps(
            state, batch, temperature, disable_lora, return_logits, record_routing
        )
        fsdp.reshard(state.model)
        return out

    def token_values(
        self, state: TrainState, batch: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """See `twinkle_fn.backends.transformers.compute.token_values`. Raises ``ValueError``
        under ulysses."""
        _refuse_ulysses(state, "tf.token_values")
        with torch.no_grad():
            values = compute.token_values(state, batch)
        fsdp.reshard(state.model)
        return {"values": values, "num_tokens": (batch["labels"] != IGNORE_INDEX).sum()}

    def update(self, state: TrainState, grads: Grads) -> tuple[TrainState, dict[str, Any]]:
        """Normalise by every data rank's tokens, then ``state.tx`` and an in-place apply."""
        placement = state.model.placement
        num_tokens = fsdp.all_reduce_dp(grads.num_tokens, placement)
        loss_sum = fsdp.all_reduce_dp(grads.loss_sum, placement)
        g = grads.params
        ls = state.loss_scale
        scale = num_tokens.clamp(min=1).double() * (1.0 if ls is None else ls.scale.item())
        updates, grad_norm = _normalised(g, 1.0 / scale, state.tx.takes_scaled)
        info = {"loss": loss_sum / num_tokens.clamp(min=1), "grad_norm": grad_norm}
        info["num_tokens"] = num_tokens
        if ls is not None:
            # float16 only: an overflowed step must be skipped, which needs the norm on the host.
            finite = bool(torch.isfinite(grad_norm))
            info.update(loss_scale=ls.scale.item(), skipped=not finite)
            ls = next_loss_scale(ls, finite)
            if not finite:
                info["lr"] = current_lr(state.opt_state)
                return state.replace(rng=next_key(state.rng), loss_scale=ls), info
        updates, opt_state = state.tx.update(updates, state.opt_state, state.params)
        apply_updates(state.params, materialise(updates))
        info["lr"] = current_lr(opt_state)
        new = state.replace(
            opt_state=opt_state, step=state.step + 1, rng=next_key(state.rng), loss_scale=ls
        )
        return new, info

    def optimizer(
        self,
        lr: Any,
        *,
        clip_grad: float = 1.0,
        loss_scale: float | None = None,
        initial_loss_scale: float | None = None,
        **adam: Any,
    ) -> GradientTransformation:
        """Clipping to `clip_grad` (0: none), then `twinkle_fn.optim.adamw` with `adam`'s
        ``b1``, ``b2``, ``eps``, ``weight_decay``. Raises ``ValueError`` for a loss scale
        (this backend keeps a dynamic one in the state, see `tf.init`)."""
        if loss_scale is not None or initial_loss_scale is not None:
            raise ValueError(
                "the transformers backend keeps its float16 loss scale in the train state; "
                "set it with tf.init(..., loss_scale=...) instead of the optimizer"
            )
        tx = adamw(lr, **adam)
        return chain(clip_by_global_norm(clip_grad), tx) if clip_grad else tx

    def grad_norm(self, state: TrainState, grads: Grads) -> torch.Tensor:
        """The norm of the token-normalised gradients, the loss scale removed (a collective)."""
        num_tokens = fsdp.all_reduce_dp(grads.num_tokens, state.model.placement)
        ls = state.loss_scale
        scale = num_tokens.clamp(min=1).double() * (1.0 if ls is None else ls.scale.item())
        return (tree_global_norm(grads.params) / scale).float()

    def after_eval(self, model: Model) -> None:
        """See `twinkle_fn.backends.transformers.fsdp.reshard`."""
        fsdp.reshard(model)

    def settle(self, model: Model) -> None:
        """Nothing runs in the background after a step here."""

    def unshard(self, state: TrainState) -> dict[str, torch.Tensor]:
        """See `twinkle_fn.backends.transformers.fsdp.unshard`."""
        return fsdp.unshard(state.params)

    def shard_params(
        self, full: Mapping[str, torch.Tensor], mesh: Mesh, model: Model, rank: int
    ) -> dict[str, torch.Tensor]:
        """See `twinkle_fn.backends.transformers.sharding.shard_params`."""
        return sharding.shard_params(full, mesh, model.config, rank)

    def unshard_params(
        self, pieces_by_rank: Mapping[int, Mapping[str, torch.Tensor]], mesh: Mesh, model: Model
    ) -> dict[str, torch.Tensor]:
        """See `twinkle_fn.backends.transformers.sharding.unshard_params`."""
        return sharding.unshard_params(pieces_by_rank, mesh, model.config)

    def shard_into(self, dst: torch.Tensor, full: torch.Tensor) -> None:
        """See `twinkle_fn.backends.transformers.fsdp.copy_into_shard`."""
        fsdp.copy_into_shard(dst, full)

    def save(self, state: TrainState, directory: Path) -> dict[str, Any]:
        """See `twinkle_fn.backends.transformers.checkpoint.save`."""
        return checkpoint.save(state, directory)

    def hf_specs(self, state: TrainState) -> tuple[dict[str, TensorSpec], frozenset[str]]:
        """See `twinkle_fn.backends.transformers.checkpoint.hf_specs`."""
        return checkpoint.hf_specs(state)

    def load(self, state: TrainState, directory: Path, manifest: Mapping[str, Any]) -> TrainState:
        """See `twinkle_fn.backends.transformers.checkpoint.load`."""
        return checkpoint.load(state, directory, manifest)

    def load_weights(
        self, state: TrainState, directory: Path, rename: Callable[[str], str] | None
    ) -> None:
        """See `twinkle_fn.backends.transformers.checkpoint.load_weights`."""
        checkpoint.load_weights(state, directory, rename)

    def add_lora(
        self, model: Model, config: LoraConfig | Mapping[str, Any], adapter_name: str
    ) -> Model:
        """See `twinkle_fn.backends.transformers.lora.add_lora`."""
        return lora.add_lora(model, config, adapter_name)

    def adapter_names(self, model: Model) -> list[str]:
        """The peft adapters injected into the module, in the order added."""
        return lora.adapter_names(model.module)

    def set_adapter(self, model: Model, adapter_name: str) -> None:
        """See `twinkle_fn.backends.transformers.lora.set_adapter`."""
        lora.set_adapter(model, adapter_name)

    def use_adapter(self, state: TrainState) -> None:
        """See `twinkle_fn.backends.transformers.lora.use_adapter`."""
        lora.use_adapter(state)

    def adapter_state_dict(self, state: TrainState) -> dict[str, torch.Tensor]:
        """See `twinkle_fn.backends.transformers.lora.adapter_state_dict`."""
        return lora.adapter_state_dict(state)

    def adapter_config(self, state: TrainState) -> LoraConfig:
        """See `twinkle_fn.backends.transformers.lora.adapter_config`."""
        return lora.adapter_config(state)

    def export_weights(
        self, state: TrainState, dtype: torch.dtype, bucket_bytes: int, lora: str
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """See `twinkle_fn.backends.transformers.export.export_weights`."""
        return export.export_weights(state, dtype, bucket_bytes, lora)


def _normalised(
    g: dict[str, torch.Tensor], inv: torch.Tensor, deferred: bool
) -> tuple[dict[str, torch.Tensor] | ScaledUpdates, torch.Tensor]:
    """The gradients `g` times the 0-d `inv`, and their global norm. `deferred` (the optimizer
    takes a `ScaledUpdates`): the factor stays pending and the norm is `g`'s times it, one read
    of the gradients instead of a multiply's read and write and then the norm's read."""
    if deferred:
        return pending_scale(g, inv)
    foreach_mul_(list(g.values()), inv)
    return g, tree_global_norm(g)


def _master_weights(model: Model) -> bool:
    """The model option ``master_weights`` (default True). Raises ``ValueError`` for a
    non-bool."""
    value = model.options.get("master_weights", True)
    if not isinstance(value, bool):
        raise ValueError(f"option master_weights must be a bool, got {value!r}")
    return value


def _ulysses_group(state: TrainState) -> dist.ProcessGroup | None:
    placement = state.model.placement
    return None if placement is None else placement.ulysses_group


def _refuse_ulysses(state: TrainState, what: str) -> None:
    """``ValueError`` for per-token outputs under ulysses (each rank holds a slice of them)."""
    if _ulysses_group(state) is not None:
        raise ValueError(
            f"{what} under mesh ulysses={state.mesh.ulysses} is not supported yet (each rank "
            "computes a slice of every row); compute it on a mesh with ulysses=1"
        )
