"""The transformers backend ("fsdp"): an HF module, sharded by FSDP2/DTensor on several ranks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from twinkle_fn.backends import fsdp, hf, hf_attention
from twinkle_fn.loss_scale import next_loss_scale
from twinkle_fn.losses import LossOutput
from twinkle_fn.mesh import Mesh
from twinkle_fn.models.model import Model
from twinkle_fn.optim import apply_updates, current_lr
from twinkle_fn.optim.base import foreach_mul_
from twinkle_fn.pytree import tree_global_norm
from twinkle_fn.state import Grads, TrainState


class TransformersBackend:
    """`twinkle_fn.backends.base.Backend` over `hf` (compute) and `fsdp` (placement)."""

    def prepare(self, model: Model, mesh: Mesh) -> Model:
        """Shard the module over `mesh` (tp plan, then FSDP2) unless it already is.

        ``Model.options["compile_layers"]``: ``True`` or a dict of ``torch.compile`` arguments
        (and ``memory_budget``, see `twinkle_fn.backends.compile_layers`) compiles each decoder
        layer (after the tp plan, before FSDP2 wraps it), fusing the norms, rotary embedding,
        SwiGLU and residual adds that eager mode runs one by one.
        The residual stream runs in the compute dtype on any mesh (`hf.cast_residual_stream`).
        A module on transformers' SDPA attention switches to `hf_attention.NAME`, which runs
        packed rows on a varlen kernel.
        """
        if model.placement is not None:
            return model
        hf.cast_residual_stream(model.module)
        hf_attention.use_varlen_attention(model.module)
        if mesh.world_size == 1:
            fsdp.compile_layers(model)
            return model
        return fsdp.parallelize(model, mesh)

    def trainable(self, model: Model) -> dict[str, torch.Tensor]:
        """The module's parameters with ``requires_grad``."""
        return {n: p for n, p in model.module.named_parameters() if p.requires_grad}

    def loss_of(self, state: TrainState, batch: Mapping[str, torch.Tensor]) -> LossOutput:
        """See `twinkle_fn.backends.hf.loss_of`."""
        return hf.loss_of(state, batch)

    def fwd_bwd(
        self, state: TrainState, batch: Mapping[str, torch.Tensor], accum: Grads | None
    ) -> tuple[Grads, dict[str, torch.Tensor]]:
        """See `twinkle_fn.backends.hf.fwd_bwd`."""
        return hf.fwd_bwd(state, batch, accum)

    def update(self, state: TrainState, grads: Grads) -> tuple[TrainState, dict[str, Any]]:
        """Normalise by every data rank's tokens, then ``state.tx`` and an in-place apply."""
        placement = state.model.placement
        num_tokens = fsdp.all_reduce_dp(grads.num_tokens, placement)
        loss_sum = fsdp.all_reduce_dp(grads.loss_sum, placement)
        g = grads.params
        ls = state.loss_scale
        scale = num_tokens.clamp(min=1).double() * (1.0 if ls is None else ls.scale.item())
        foreach_mul_(list(g.values()), 1.0 / scale)
        grad_norm = tree_global_norm(g)
        info = {"loss": loss_sum / num_tokens.clamp(min=1), "grad_norm": grad_norm}
        info["num_tokens"] = num_tokens
        if ls is not None:
            # float16 only: an overflowed step must be skipped, which needs the norm on the host.
            finite = bool(torch.isfinite(grad_norm))
            info.update(loss_scale=ls.scale.item(), skipped=not finite)
            ls = next_loss_scale(ls, finite)
            if not finite:
                info["lr"] = current_lr(state.opt_state)
                return state.replace(rng=hf.next_key(state.rng), loss_scale=ls), info
        updates, opt_state = state.tx.update(g, state.opt_state, state.params)
        apply_updates(state.params, updates)
        info["lr"] = current_lr(opt_state)
        new = state.replace(
            opt_state=opt_state, step=state.step + 1, rng=hf.next_key(state.rng), loss_scale=ls
        )
        return new, info

    def after_eval(self, model: Model) -> None:
        """See `twinkle_fn.backends.fsdp.reshard`."""
        fsdp.reshard(model)

    def settle(self, model: Model) -> None:
        """Nothing runs in the background after a step here."""

    def unshard(self, state: TrainState) -> dict[str, torch.Tensor]:
        """See `twinkle_fn.backends.fsdp.unshard`."""
        return fsdp.unshard(state.params)
