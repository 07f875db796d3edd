"""Router facts on the transformers backend: a forward hook on every MoE router feeds a
`twinkle_fn.moe.RouterPass` (expert load, router losses) and replays recorded experts.

transformers 5's MoE routers (``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``, ``Glm4MoeTopkRouter``
...) share one contract: ``router(hidden [N, H]) -> (logits [N, E], weights [N, k], indices
[N, k])``, and the model class names its router class as the source of ``router_logits``
(``_can_record_outputs``). The hook sees each layer's routing and may return other weights and
indices: replayed experts get their weights from the current logits by the family's scoring
(`twinkle_fn.models.families.Moe`: softmax or sigmoid, renormalised or not, scaled), exactly
what the router computes for the experts it picks itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import transformers
from torch import Tensor
from torch.distributed.tensor import DTensor

from twinkle_fn.models.families import family, flag_on
from twinkle_fn.models.model import Model
from twinkle_fn.moe import (
    ROUTED_EXPERTS,
    ROUTER_TOKEN,
    RouterPass,
    record_part,
    replay_targets,
    router_loss,
    token_places,
)

_CTX = "_twinkle_router_ctx"  # on each router: a one-slot list holding the active context
_LAYER = "_twinkle_moe_layer"
_ROUTERS = "_twinkle_moe_routers"  # on the module: its hooked routers


def moe_routers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """`module`'s MoE routers in layer order (the class its model records ``router_logits``
    from); [] for a dense model."""
    target = None
    for m in module.modules():
        rec = getattr(type(m), "_can_record_outputs", None) or {}
        if "router_logits" in rec:
            target = rec["router_logits"].target_class
            break
    if target is None:
        return []
    return [m for m in module.modules() if isinstance(m, target)]


class _Context:
    """What the hooks read during one forward: the pass, each token's validity and the replay
    targets (``[L, N, k]``), in the routers' token order."""

    def __init__(self, rp: RouterPass | None, valid: Tensor, targets: Tensor | None) -> None:
        self.rp, self.valid, self.targets = rp, valid, targets


def _install(model: Model) -> list[torch.nn.Module]:
    """Hook the model's routers once; returns them. Raises ``ValueError`` when their number
    differs from the family's MoE layers."""
    routers = getattr(model.module, _ROUTERS, None)
    if routers is not None:
        return routers
    routers = moe_routers(model.module)
    want = len(family(model.config).moe_layers(model.config))
    if len(routers) != want:
        raise ValueError(
            f"found {len(routers)} MoE routers in this {model.family} model but its family has "
            f"{want} MoE layers; router losses, routing records and replay need one router "
            f"module per MoE layer (transformers {transformers.__version__} exposes "
            f"{len(routers)}): upgrade transformers, or use the megatron backend"
        )
    slot: list[_Context | None] = getattr(routers[0], _CTX, None) if routers else None
    if routers and slot is None:
        slot = [None]
        weights = _replay_weights(model)
        for i, r in enumerate(routers):
            setattr(r, _CTX, slot)
            setattr(r, _LAYER, i)
            r.register_forward_hook(_make_hook(slot, i, weights))
    setattr(model.module, _ROUTERS, routers)
    return routers


def _make_hook(slot: list[_Context | None], layer: int, weights: Callable[..., Tensor]):
    def hook(_module: torch.nn.Module, _args: Any, out: Any) -> Any:
        ctx = slot[0]
        if ctx is None:
            return None
        logits, w, idx = out
        local = logits.to_local() if isinstance(logits, DTensor) else logits
        if ctx.targets is not None:
            # padding keeps the router's own choice: a record holds nothing meaningful there
            keep = ctx.valid.to(idx.device)[:, None]
            idx = torch.where(keep, ctx.targets[layer].to(idx.device), idx)
            w = weights(logits, idx, w.dtype)
        if ctx.rp is not None:
            ctx.rp.observe(layer, local, idx, ctx.valid)
            w = ctx.rp.attach(layer, w, local, ctx.valid)
        return logits, w, idx

    # eager inside a compiled decoder layer (option compile_layers): the bookkeeping has Python
    # side effects
    return torch._dynamo.disable(hook, reason="twinkle router bookkeeping")


def _replay_weights(model: Model) -> Callable[[Tensor, Tensor, torch.dtype], Tensor]:
    """The family's routing weights ``[N, k]`` of chosen experts `idx` from `logits`."""
    moe = family(model.config).moe
    renorm = flag_on(moe.renormalize, model.config)
    scale = None if moe.scale is None else float(getattr(model.config, moe.scale))

    def weights(logits: Tensor, idx: Tensor, dtype: torch.dtype) -> Tensor:
        x = logits.float()
        scores = torch.softmax(x, -1) if moe.score == "softmax" else torch.sigmoid(x)
        w = scores.gather(1, idx)
        if renorm:
            w = w / (w.sum(-1, keepdim=True) + (1e-20 if moe.score == "sigmoid" else 0.0))
        if scale is not None:
            w = w * scale
        return w.to(dtype)

    return weights


def new_pass(model: Model, *, record: bool = False) -> RouterPass | None:
    """A `RouterPass` for one forward of `model`, hooks installed; None for a dense model, and
    for an MoE model whose routers this transformers does not expose (older versions score some
    families' routing inside the MoE block, not in a router module) when nothing but the
    expert load was asked for: no router loss, no recording. Raises ``ValueError`` as
    `_install` when a router loss or recording needs the routers."""
    moe = family(model.config).moe
    if moe is None:
        return None
    cfg = model.config
    loss = router_loss(model.options, cfg)
    if not (record or loss.active) and not moe_routers(model.module):
        return None
    routers = _install(model)
    return RouterPass(
        len(routers),
        getattr(cfg, moe.num_experts),
        getattr(cfg, moe.top_k),
        loss,
        moe.score,
        record=record,
    )


@contextlib.contextmanager
def routing(
    model: Model, rp: RouterPass | None, batch: Mapping[str, Tensor], *, keep: bool = False
) -> Iterator[None]:
    """Route the forwards inside through `rp` (may be None: replay only) over `batch` (a local
    batch from `twinkle_fn.moe.with_token_field`), replaying ``batch["routed_experts"]`` when
    present. With `keep` the routing stays on after the block, for the backward's
    recomputation of checkpointed layers, until `release`."""
    if ROUTER_TOKEN not in batch or (rp is None and ROUTED_EXPERTS not in batch):
        yield
        return
    routers = _install(model)
    index, valid, _ = token_places(batch[ROUTER_TOKEN].to(model.device))
    targets = None
    if ROUTED_EXPERTS in batch:
        targets = replay_targets(batch[ROUTED_EXPERTS], index)
    slot = getattr(routers[0], _CTX)
    slot[0] = _Context(rp, valid, targets)
    try:
        yield
    finally:
        if not keep:
            slot[0] = None


def release(model: Model) -> None:
    """End the routing a `routing` block kept on (nothing for a dense model)."""
    routers = getattr(model.module, _ROUTERS, None)
    if routers:
        getattr(routers[0], _CTX)[0] = None


def recorded(rp: RouterPass, batch: Mapping[str, Tensor]) -> Tensor:
    """The routing record ``[B, T, L, k]`` (`twinkle_fn.moe`) of the forward `rp` recorded over
    `batch` (with its `ROUTER_TOKEN`, on one rank's whole rows)."""
    field = batch[ROUTER_TOKEN]
    index, _, present = token_places(field)
    part = record_part(rp, field.numel(), present, index)
    return (part - 1).view(*field.shape, rp.num_layers, rp.top_k)
