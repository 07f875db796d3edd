"""One forward's router bookkeeping (`RouterPass`), which a backend's router hook feeds: the
router losses' statistics and gradient (`twinkle_fn.moe.losses`), the expert load and the
routing a replay record is made of.

**Expert load**: ``[L, E]`` int64, the tokens routed to each expert of each MoE layer (the
experts the model really used, replayed ones included), padding excluded, summed over every
data rank: ``tf.fwd_bwd``'s ``aux["expert_load"]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from twinkle_fn.moe.losses import RouterLoss, load_balancing_loss, router_terms, z_loss


def expert_counts(indices: Tensor, valid: Tensor | None, num_experts: int) -> Tensor:
    """``[E]`` float64: how many of the tokens `valid` ``[N]`` (None: all) list each expert in
    `indices` ``[N, k]``."""
    w = torch.ones(indices.shape[0], dtype=torch.float64, device=indices.device)
    if valid is not None:
        w = valid.to(torch.float64)
    out = torch.zeros(num_experts, dtype=torch.float64, device=indices.device)
    return out.scatter_add_(0, indices.reshape(-1).long(), w.repeat_interleave(indices.shape[1]))


class RouterPass:
    """One forward's router bookkeeping, which a backend's router hook feeds.

    Made per forward (no state outlives it): `observe` takes each MoE layer's routing once
    (`layer` is the MoE layer's index among the model's MoE layers); `attach` makes the router
    losses' gradient flow into a layer's logits when the backward reaches the routing weights;
    `finish` sums the statistics over the data ranks (one all-reduce) before the backward;
    `info` reports them. Calls after `finish` (activation recomputation in the backward)
    observe nothing. `grad_scale` gives the factor the backward's gradients carry (a float16
    loss scale; 1 otherwise), read when the backward runs.
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        top_k: int,
        loss: RouterLoss,
        score: str,
        *,
        record: bool = False,
        grad_scale: Callable[[], float | Tensor] = lambda: 1.0,
    ) -> None:
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.loss, self.record = loss, record
        # "hf" reads transformers' softmax scores; "megatron" the router's own score function
        self.score = "softmax" if loss.aux_kind == "hf" else score
        self.grad_scale = grad_scale
        self.finished = False
        self._load: list[Tensor] = []
        self._counts: list[Tensor] = []
        self._probs: list[Tensor] = []
        self._lse: list[Tensor] = []
        self._tokens: list[Tensor] = []
        self._layers: list[int] = []
        self.recorded: dict[int, list[Tensor]] = {}
        self.stats: dict[str, Tensor] = {}

    def observe(self, layer: int, logits: Tensor, indices: Tensor, valid: Tensor | None) -> None:
        """Take MoE layer `layer`'s routing of one (micro-)batch: `logits` ``[N, E]``, the
        experts used `indices` ``[N, k]``, the non-padding tokens `valid` ``[N]`` (None:
        all). Nothing after `finish`."""
        if self.finished:
            return
        with torch.no_grad():
            self._layers.append(layer)
            self._load.append(expert_counts(indices, valid, self.num_experts))
            n = indices.shape[0] if valid is None else valid.sum()
            self._tokens.append(torch.as_tensor(n, dtype=torch.float64, device=indices.device))
            if self.loss.active:
                counts, probs, lse = router_terms(logits.detach(), valid, self.top_k, self.score)
                self._counts.append(counts.double())
                self._probs.append(probs.double())
                self._lse.append(lse.double())
            if self.record:
                self.recorded.setdefault(layer, []).append(indices.detach().sort(-1).values)

    def attach(self, layer: int, weights: Tensor, logits: Tensor, valid: Tensor | None) -> Tensor:
        """`weights` unchanged; in the backward, `logits` ``[N, E]`` also receive the gradient
        of this layer's part of the router losses (over the tokens `valid`). `weights` itself
        when no router loss is trained or gradients are off."""
        if not self.loss.active or not torch.is_grad_enabled() or not logits.requires_grad:
            return weights
        return _AttachRouterLoss.apply(weights, logits, valid, self, layer)

    def statistics(self, num_tokens: Tensor, *, duplicate: bool = False) -> Tensor:
        """This rank's part of the statistics `finish` sums over the data ranks: one float64
        vector (expert loads, aux counts and score sums ``[L, E]`` each, z sums and token counts
        ``[L]``, and `num_tokens`), zeros but `num_tokens` for a `duplicate` rank (one that
        routed the same tokens as another: tensor parallelism without sequence parallelism)."""
        device = num_tokens.device
        lcount, experts = self.num_layers, self.num_experts
        load = torch.zeros(lcount, experts, dtype=torch.float64, device=device)
        tokens = torch.zeros(lcount, dtype=torch.float64, device=device)
        counts = torch.zeros(lcount, experts, dtype=torch.float64, device=device)
        probs = torch.zeros(lcount, experts, dtype=torch.float64, device=device)
        lse = torch.zeros(lcount, dtype=torch.float64, device=device)
        for i, layer in enumerate([] if duplicate else self._layers):
            load[layer] += self._load[i].to(device)
            tokens[layer] += self._tokens[i].to(device)
            if self.loss.active:
                counts[layer] += self._counts[i].to(device)
                probs[layer] += self._probs[i].to(device)
                lse[layer] += self._lse[i].to(device)
        parts = [load.reshape(-1), counts.reshape(-1), probs.reshape(-1), lse, tokens]
        return torch.cat([*parts, num_tokens.reshape(1).to(torch.float64)])

    def finish(
        self,
        num_tokens: Tensor,
        all_reduce: Callable[[Tensor], None] | None,
        *,
        duplicate: bool = False,
    ) -> None:
        """Sum the `statistics` over the data ranks (`all_reduce` sums a float64 tensor in place
        over every rank holding other tokens; None on one) with this forward's loss token count
        `num_tokens` (``N_f``, this rank's part). Every rank must call it."""
        flat = self.statistics(num_tokens, duplicate=duplicate)
        if all_reduce is not None:
            all_reduce(flat)
        lcount, experts = self.num_layers, self.num_experts
        n = lcount * experts
        load, counts, probs, rest = flat.split([n, n, n, flat.numel() - 3 * n])
        lse, tokens, num = rest[:lcount], rest[lcount:-1], rest[-1]
        # every layer sees every token: the largest count is the forward's (a layer on another
        # pipeline stage shows 0 here)
        self.stats = {
            "load": load.view(lcount, experts),
            "counts": counts.view(lcount, experts),
            "probs": probs.view(lcount, experts),
            "lse": lse,
            "tokens": tokens.max(),
            "num_tokens": num,
        }
        self.finished = True

    def info(self) -> dict[str, Tensor]:
        """After `finish`: ``expert_load`` ``[L, E]`` int64, and with a router loss trained
        ``aux_loss`` and ``z_loss`` (0-d float32, the definitions' values over every data
        rank, before their coefficients)."""
        s = self.stats
        out = {"expert_load": s["load"].round().long()}
        if self.loss.active:
            kind = self.loss.aux_kind
            aux = load_balancing_loss(s["counts"], s["probs"], s["tokens"], self.top_k, kind)
            out["aux_loss"] = aux.float()
            out["z_loss"] = z_loss(s["lse"], s["tokens"], kind).float()
        return out

    def layer_loss(self, layer: int, logits: Tensor, valid: Tensor | None) -> Tensor:
        """The router losses' part that depends on layer `layer`'s local `logits` (the other
        layers' and ranks' statistics held constant), weighted by ``N_f``: its gradient is the
        layer's. Needs `finish`."""
        s, loss = self.stats, self.loss
        _, probs, lse = router_terms(logits, valid, self.top_k, self.score)
        out = probs.new_zeros(())
        if loss.aux_coef > 0:
            rows = [
                probs if i == layer else torch.zeros_like(probs) for i in range(self.num_layers)
            ]
            counts = s["counts"].to(probs.dtype)
            aux = load_balancing_loss(
                counts, torch.stack(rows), s["tokens"], self.top_k, loss.aux_kind
            )
            out = out + loss.aux_coef * aux
        if loss.z_coef > 0:
            one = [lse if i == layer else torch.zeros_like(lse) for i in range(self.num_layers)]
            out = out + loss.z_coef * z_loss(torch.stack(one), s["tokens"], loss.aux_kind)
        return out * s["num_tokens"].to(out.dtype)


class _AttachRouterLoss(torch.autograd.Function):
    """Identity on the routing weights whose backward adds a layer's router-loss gradient to
    its logits (megatron-core's ``MoEAuxLossAutoScaler`` idea: no extra loss term, so it works
    under activation recomputation and with the statistics summed after the forward)."""

    @staticmethod
    def forward(
        ctx: Any, weights: Tensor, logits: Tensor, valid: Any, rp: Any, layer: int
    ) -> Tensor:
        ctx.save_for_backward(logits)
        ctx.valid, ctx.rp, ctx.layer = valid, rp, layer
        return weights.view_as(weights)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        (logits,) = ctx.saved_tensors
        rp: RouterPass = ctx.rp
        if not rp.finished:
            raise RuntimeError(
                "the router losses' gradient is needed before RouterPass.finish summed the "
                "router statistics; the backend must call finish between forward and backward"
            )
        with torch.enable_grad():
            x = logits.detach().requires_grad_(True)
            value = rp.layer_loss(ctx.layer, x, ctx.valid)
            (g,) = torch.autograd.grad(value, x)
        scale = rp.grad_scale()
        g = g * (scale.to(g.device, g.dtype) if isinstance(scale, Tensor) else float(scale))
        return grad, g.to(logits.dtype), None, None, None
