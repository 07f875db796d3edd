"""Router facts on the megatron backend: each ``TopKRouter``'s ``routing`` feeds a
`twinkle_fn.moe.RouterPass` (expert load, router losses) and replays recorded experts.

megatron-core's own router losses (``moe_aux_loss_coeff``, ``moe_z_loss_coeff``) are turned
off (`twinkle_fn.backends.megatron.placement`): twinkle's are defined once for both backends
(`twinkle_fn.moe`), over every data rank's tokens with exact normalisation. Replay uses
megatron-core's hook for it, the router's ``router_replay`` object asked for each top-k
(``get_replay_topk``), with one object per router of this model rather than megatron-core's
``RouterReplay``, whose registry of every router ever built is global (a second model in the
process would not match it).

Token order. A router sees its stage's ``[s, b]`` tokens flattened sequence-major (each
tensor-parallel rank its ``s / tp`` slice under sequence parallelism, each context-parallel
rank its chunks); `twinkle_fn.moe.ROUTER_TOKEN` travels as a batch field through the
micro-batches and the context-parallel split, so each router call knows the batch place of
its tokens. Router losses and replay need one pipeline stage (the statistics are summed
between a micro-batch's forward and its backward).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.moe.router import TopKRouter
from torch import Tensor

from twinkle_fn.models.families import family
from twinkle_fn.moe import (
    ROUTER_TOKEN,
    RouterLoss,
    RouterPass,
    record_part,
    replay_targets,
    token_field,
    token_places,
)

_HOOKED = "_twinkle_router_slot"


class _Context:
    """One micro-batch's routing context: its pass, the batch places of its tokens in router
    order (``[n]``), and the replay record (``[B, T, L, k]``) when replaying."""

    def __init__(self, rp: RouterPass | None, field: Tensor, record: Tensor | None) -> None:
        self.rp = rp
        self.index, self.valid, self.present = token_places(field.t())  # [s, b] -> s-major
        self.record = record

    def local(self, n: int) -> tuple[Tensor, Tensor, Tensor]:
        """``(index, valid, present)`` of the `n` tokens a router sees (a sequence-parallel
        rank's slice of the micro-batch)."""
        total = self.index.numel()
        if n == total:
            return self.index, self.valid, self.present
        rank = parallel_state.get_tensor_model_parallel_rank()
        part = slice(rank * n, (rank + 1) * n)
        return self.index[part], self.valid[part], self.present[part]


class _Replay:
    """megatron-core's ``router_replay`` protocol for one router: the experts of the current
    micro-batch's record, or the router's own top-k."""

    def __init__(self, slot: list[_Context | None], layer: int) -> None:
        self.slot, self.layer = slot, layer
        self.layer_number: int | None = None  # megatron's set_layer_number writes it

    @torch._dynamo.disable(reason="twinkle routing replay: reads the current micro-batch")
    def get_replay_topk(
        self,
        scores: Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable[..., tuple[Tensor, Tensor]] | None = None,
    ) -> tuple[Tensor, Tensor]:
        ctx = self.slot[0]
        if ctx is None or ctx.record is None:
            return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        index, valid, _ = ctx.local(scores.shape[0])
        idx = replay_targets(ctx.record, index)[self.layer].to(scores.device)  # [n, k]
        # padding (the batch's and the backend's) keeps the router's own choice: a record
        # holds nothing meaningful there
        own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)[1]
        idx = torch.where(valid.to(idx.device)[:, None], idx, own)
        return scores.gather(1, idx), idx


def _routers(module: torch.nn.Module, config: Any) -> list[tuple[int, TopKRouter]]:
    """This stage's routers with their MoE-layer index (among the model's MoE layers)."""
    moe_layers = list(family(config).moe_layers(config))
    out = []
    for m in module.modules():
        if isinstance(m, TopKRouter):
            out.append((moe_layers.index(m.layer_number - 1), m))
    return out


def install(module: torch.nn.Module, config: Any) -> list[_Context | None]:
    """Hook the routers of `module` (this rank's ``GPTModel`` stage) once; returns the slot
    whose context every hooked router reads."""
    slot = getattr(module, _HOOKED, None)
    if slot is not None:
        return slot
    slot = [None]
    for layer, router in _routers(module, config):
        router.router_replay = _Replay(slot, layer)
        router.routing = _routing(router, router.routing, slot, layer)
    setattr(module, _HOOKED, slot)
    return slot


def _routing(
    router: TopKRouter, routing: Callable[..., Any], slot: list[_Context | None], layer: int
) -> Callable[..., Any]:
    def hooked(logits: Tensor, padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        probs, routing_map = routing(logits, padding_mask=padding_mask)
        return _book(slot, layer, router.topk, logits, probs, routing_map)

    return hooked


@torch._dynamo.disable(reason="twinkle router bookkeeping")
def _book(
    slot: list[_Context | None],
    layer: int,
    topk: int,
    logits: Tensor,
    probs: Tensor,
    routing_map: Tensor,
) -> tuple[Tensor, Tensor]:
    """Feed the current micro-batch's `RouterPass` one layer's routing; the routing weights
    `probs`, carrying the router losses' gradient. Eager inside a compiled router (option
    compile_layers): it has Python side effects, and reads the context fresh each call."""
    ctx = slot[0]
    if ctx is None or ctx.rp is None:
        return probs, routing_map
    flat = logits.reshape(-1, logits.shape[-1])  # [s * b, E], sequence-major
    _, valid, _ = ctx.local(flat.shape[0])
    idx = routing_map.float().topk(topk, dim=-1).indices  # [n, k]: its True columns
    ctx.rp.observe(layer, flat, idx, valid)
    return ctx.rp.attach(layer, probs, flat, valid), routing_map


class RouterRun:
    """The router side of one `forward_backward` call: a `RouterPass` per micro-batch when
    router losses train (finished in its loss function, before its backward), else one for
    the whole call; `begin` is called before each micro-batch's forward. `sequence_parallel`:
    whether tensor-parallel ranks route different slices of the tokens."""

    def __init__(
        self,
        module: torch.nn.Module,
        config: Any,
        loss: RouterLoss,
        *,
        record: Tensor | None,
        record_routing: bool,
        sequence_parallel: bool,
    ) -> None:
        moe = family(config).moe
        self.slot = install(module, config)
        self.loss, self.record, self.record_routing = loss, record, record_routing
        self.sequence_parallel = sequence_parallel
        self.args = (
            len(family(config).moe_layers(config)),
            getattr(config, moe.num_experts),
            getattr(config, moe.top_k),
        )
        self.score = moe.score
        self.passes: list[RouterPass] = []
        self.contexts: list[_Context] = []

    def begin(self, fields: Mapping[str, Tensor]) -> None:
        """Route the next micro-batch (its fields hold `ROUTER_TOKEN`)."""
        if self.loss.active or not self.passes:
            rp = RouterPass(
                *self.args,
                self.loss,
                self.score,
                record=self.record_routing,
                grad_scale=_grad_scale,
            )
            self.passes.append(rp)
        ctx = _Context(self.passes[-1], fields[ROUTER_TOKEN], self.record)
        self.contexts.append(ctx)
        self.slot[0] = ctx

    def finish_micro_batch(self, num_tokens: Tensor) -> None:
        """Sum the current micro-batch's statistics over the data ranks (router losses only:
        every rank runs it in its loss function, before the backward)."""
        if self.loss.active:
            self._finish(self.passes[-1], num_tokens)

    def end(self, device: torch.device) -> dict[str, Tensor]:
        """Stop routing; the call's `twinkle_fn.moe.RouterPass.info` (loads summed over the
        micro-batches, router losses their token-weighted mean)."""
        self.slot[0] = None
        if not self.passes:
            return {}
        if not self.loss.active:
            self._finish(self.passes[0], torch.zeros((), device=device))
        infos = [rp.info() for rp in self.passes]
        out = {"expert_load": sum(i["expert_load"] for i in infos)}
        if self.loss.active:
            w = torch.stack([rp.stats["num_tokens"] for rp in self.passes])
            w = w / w.sum().clamp(min=1)
            for key in ("aux_loss", "z_loss"):
                vals = torch.stack([i[key].double() for i in infos])
                out[key] = (vals * w.to(vals.device)).sum().float()
        return out

    def recorded(self, batch: Mapping[str, Tensor]) -> Tensor:
        """The routing record ``[B, T, L, k]`` of `batch` (this data rank's), assembled over
        the ranks that split its tokens (sequence-parallel tp ranks, context-parallel ranks)."""
        field = token_field(batch)
        rp = self.passes[0]
        seen = [t.shape[0] for t in rp.recorded[0]]  # tokens each micro-batch's routers saw
        places = [ctx.local(n) for ctx, n in zip(self.contexts, seen, strict=True)]
        index = torch.cat([p[0] for p in places])
        present = torch.cat([p[2] for p in places])
        part = record_part(rp, field.numel(), present, index)
        if self.sequence_parallel and parallel_state.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(part, group=parallel_state.get_tensor_model_parallel_group())
        if parallel_state.get_context_parallel_world_size() > 1:
            dist.all_reduce(part, group=parallel_state.get_context_parallel_group())
        return (part - 1).view(*field.shape, rp.num_layers, rp.top_k)

    def _finish(self, rp: RouterPass, num_tokens: Tensor) -> None:
        """`RouterPass.finish` over every rank: tensor-parallel ranks other than the first add
        nothing they share with it (the loss count always; the router statistics unless
        sequence parallelism split the tokens)."""
        shared = parallel_state.get_tensor_model_parallel_rank() != 0
        n = torch.zeros_like(num_tokens) if shared else num_tokens
        reduce = (lambda t: dist.all_reduce(t)) if dist.get_world_size() > 1 else None
        rp.finish(n.double(), reduce, duplicate=shared and not self.sequence_parallel)


def _grad_scale() -> Tensor | float:
    """The factor megatron's schedule scales the loss by (the optimizer's loss scale)."""
    scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    return 1.0 if scale is None else scale
