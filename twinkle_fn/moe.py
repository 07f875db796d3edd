"""Router facts of mixture-of-experts models, defined once for every backend: the load-balancing
(aux) and z losses, each MoE layer's expert load, and routing-replay records.

**Router losses** (`RouterLoss`, the model option ``"router_loss"``, see `router_loss`). Per MoE
layer ``l`` of ``L``, over the ``T`` non-padding tokens of one forward (every data rank's, see
below), with ``E`` experts, top-``k`` routing, ``c[l, e]`` the tokens whose top-``k`` *scores*
include expert ``e`` and ``s[l, e]`` the sum over tokens of expert ``e``'s score:

- ``"hf"`` (transformers' ``load_balancing_loss_func``, one loss over every layer's router
  logits concatenated): ``aux = E * sum_e (sum_l c[l, e] / (L T)) * (sum_l s[l, e] / (L T))``,
  scores the softmax of the logits; z-loss (transformers' Switch ``router_z_loss_func`` over the
  concatenated logits) ``z = sum_l sum_t lse[l, t]^2 / (L T)``.
- ``"megatron"`` (megatron-core's ``switch_load_balancing_loss_func``, one loss per layer,
  summed over layers): ``aux = sum_l E / (k T^2) * sum_e c[l, e] * s[l, e]``, scores the
  router's score function (softmax, or sigmoid normalised over experts); z-loss
  (``z_loss_func``) ``z = sum_l sum_t lse[l, t]^2 / T``.

With one layer, ``"hf"``'s aux is ``k`` times ``"megatron"``'s (HF's fraction ``c / T`` counts
each token ``k`` times); with several, ``"hf"`` couples the layers (its cross terms ``c[l] s[m]``)
and averages them where ``"megatron"`` sums.

Token normalisation. The core trains token sums and divides once by the loss's token count
``N`` of every micro-batch and data rank (``tf.step``). A forward's router losses enter the sum
as ``N_f * (aux_coef * aux + z_coef * z)``, ``N_f`` the loss's count of that forward over every
data rank, and ``aux``/``z`` are computed over that forward's tokens on every data rank
(counts and ``T`` summed over them; padding, and tokens a backend adds to reach a sequence
multiple, excluded). So one forward gives exactly transformers' ``loss + coef * aux`` (on
any mesh: the same as one process), and several accumulated forwards the ``N_f``-weighted mean
of their router losses. The gradient is injected where the router's weights are used
(`RouterPass.attach`), so it survives activation recomputation.

**Expert load**: ``[L, E]`` int64, the tokens routed to each expert of each MoE layer (the
experts the model really used, replayed ones included), padding excluded, summed over every
data rank: ``tf.fwd_bwd``'s ``aux["expert_load"]``.

**Routing replay**: a record (`ROUTED_EXPERTS`) is ``[B, T, L, k]`` int64 in the batch's own
layout (``[1, T, L, k]`` for a packed row): each token's ``k`` experts per MoE layer, sorted
ascending. ``tf.token_logps(..., record_routing=True)`` returns it; a batch carrying it under
``"routed_experts"`` makes ``tf.fwd_bwd`` / ``tf.token_logps`` route every non-padding token to
those experts (its routing weights recomputed from the current router for them; padding keeps
the router's own choice).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from twinkle_fn.models.families import family

AUX_KINDS = ("hf", "megatron")
ROUTER_LOSS_OPTION = "router_loss"
ROUTED_EXPERTS = "routed_experts"


@dataclasses.dataclass(frozen=True)
class RouterLoss:
    """The router losses a model trains with (see the module docstring for the formulas).

    `aux_coef`: the load-balancing loss's coefficient (0: off); `aux_kind`: its definition,
    ``"hf"`` (one loss jointly over all layers, transformers') or ``"megatron"`` (per layer,
    summed; megatron-core's); `z_coef`: the router z-loss's coefficient (0: off), defined by the
    same kind. Raises ``ValueError`` for a negative or non-finite coefficient or another kind.
    """

    aux_coef: float = 0.0
    aux_kind: str = "hf"
    z_coef: float = 0.0

    def __post_init__(self) -> None:
        for name in ("aux_coef", "z_coef"):
            value = getattr(self, name)
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if not ok or not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"router_loss {name} must be a finite number >= 0, got {value!r}; "
                    "use 0 to turn the loss off"
                )
        if self.aux_kind not in AUX_KINDS:
            raise ValueError(
                f"router_loss aux_kind must be one of {AUX_KINDS}, got {self.aux_kind!r}: "
                "'hf' is transformers' joint loss over all layers, 'megatron' megatron-core's "
                "per-layer loss"
            )

    @property
    def active(self) -> bool:
        """Whether any router loss is trained."""
        return self.aux_coef > 0 or self.z_coef > 0


def router_loss(options: Mapping[str, Any], config: Any) -> RouterLoss:
    """The `RouterLoss` of a model from its options and HF config.

    ``options["router_loss"]``: a `RouterLoss` or a dict of its fields. Without it, the HF
    config's own: ``router_aux_loss_coef`` with the ``"hf"`` definition when
    ``output_router_logits`` is set (transformers adds the aux loss exactly then), and
    ``router_z_loss_coef`` if the config has one; else no router loss. Raises ``TypeError`` for
    another type, ``ValueError`` for unknown fields or bad values (see `RouterLoss`).
    """
    value = options.get(ROUTER_LOSS_OPTION)
    if value is None:
        if not getattr(config, "output_router_logits", False):
            return RouterLoss()
        z = float(getattr(config, "router_z_loss_coef", 0.0) or 0.0)
        return RouterLoss(float(config.router_aux_loss_coef), "hf", z)
    if isinstance(value, RouterLoss):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(
            f"option router_loss must be a twinkle_fn.moe.RouterLoss or a dict of its fields, "
            f"got {type(value).__name__}"
        )
    known = {f.name for f in dataclasses.fields(RouterLoss)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(
            f"option router_loss has unknown field(s) {unknown}; its fields are {sorted(known)}"
        )
    return RouterLoss(**value)


def router_scores(logits: Tensor, score: str) -> Tensor:
    """``[N, E]`` float32 (float64 for float64 logits) router scores the aux loss reads:
    ``"softmax"`` over experts, or ``"sigmoid"`` normalised to sum to 1 over experts (as
    megatron-core's aux loss scores a sigmoid router). Raises ``ValueError`` for another
    `score`."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if score == "softmax":
        return torch.softmax(x, dim=-1)
    if score == "sigmoid":
        s = torch.sigmoid(x)
        return s / (s.sum(dim=-1, keepdim=True) + 1e-20)
    raise ValueError(f"router score {score!r} is not 'softmax' or 'sigmoid'")


def load_balancing_loss(
    counts: Tensor, prob_sums: Tensor, num_tokens: Tensor | float, top_k: int, kind: str
) -> Tensor:
    """The aux loss of `kind` (module docstring) from per-layer statistics.

    `counts` ``[L, E]``: tokens whose top-`top_k` scores include each expert; `prob_sums`
    ``[L, E]``: each expert's score summed over tokens; `num_tokens`: ``T``, the tokens each
    layer saw. Linear in `prob_sums`. Returns a 0-d tensor. Raises ``ValueError`` for an
    unknown `kind`.
    """
    layers, experts = counts.shape
    t = torch.as_tensor(num_tokens, dtype=prob_sums.dtype, device=prob_sums.device).clamp(min=1)
    counts = counts.to(prob_sums.dtype)
    if kind == "hf":
        f = counts.sum(0) / (layers * t)
        p = prob_sums.sum(0) / (layers * t)
        return experts * (f * p).sum()
    if kind == "megatron":
        return (experts / (top_k * t * t)) * (counts * prob_sums).sum()
    raise ValueError(f"aux_kind {kind!r} is not one of {AUX_KINDS}")


def z_loss(lse_sq_sums: Tensor, num_tokens: Tensor | float, kind: str) -> Tensor:
    """The router z-loss of `kind` (module docstring): `lse_sq_sums` ``[L]`` is each layer's
    sum over tokens of ``logsumexp(logits)^2``, `num_tokens` ``T``. Linear in `lse_sq_sums`.
    Returns a 0-d tensor. Raises ``ValueError`` for an unknown `kind`."""
    t = torch.as_tensor(num_tokens, dtype=lse_sq_sums.dtype, device=lse_sq_sums.device)
    t = t.clamp(min=1)
    if kind == "hf":
        return lse_sq_sums.sum() / (lse_sq_sums.shape[0] * t)
    if kind == "megatron":
        return lse_sq_sums.sum() / t
    raise ValueError(f"aux_kind {kind!r} is not one of {AUX_KINDS}")


def router_terms(
    logits: Tensor, valid: Tensor | None, top_k: int, score: str
) -> tuple[Tensor, Tensor, Tensor]:
    """One layer's aux-loss statistics of `logits` ``[N, E]`` over the tokens `valid` ``[N]``
    (bool; None: all): ``(counts [E], prob_sums [E], lse_sq_sum [])``, counts without
    gradient, the sums differentiable in float32 (float64 for float64 logits)."""
    scores = router_scores(logits, score)  # [N, E]
    lse = torch.logsumexp(logits.to(scores.dtype), dim=-1)  # [N]
    top = scores.detach().topk(top_k, dim=-1).indices  # [N, k]
    w = torch.ones(scores.shape[0], dtype=scores.dtype, device=scores.device)
    if valid is not None:
        w = valid.to(scores.dtype)
    counts = torch.zeros(scores.shape[1], dtype=scores.dtype, device=scores.device)
    counts.scatter_add_(0, top.reshape(-1), w.repeat_interleave(top_k))
    return counts, (scores * w[:, None]).sum(0), (lse.square() * w).sum()


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


ROUTER_TOKEN = "router_token"
"""The batch field a backend adds (`token_field`) so that each token's place in the batch travels
with it through micro-batches, sequence splits and padding."""


def token_field(batch: Mapping[str, Tensor]) -> Tensor:
    """``[B, T]`` int64: ``p + 1`` for the token at flat position ``p`` of `batch` (row-major),
    negated on padding (``attention_mask`` 0). A backend's own padding, filled with 0, is
    neither (see `token_places`)."""
    ids = batch["input_ids"]
    pos = torch.arange(1, ids.numel() + 1, device=ids.device).view(ids.shape)
    mask = batch.get("attention_mask")
    if mask is None or "cu_seqlens" in batch:
        return pos
    return torch.where(mask.to(ids.device).bool(), pos, -pos)


def token_places(field: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """From `token_field` values (any shape, flattened in the order given): ``(index, valid,
    present)``, each ``[n]``: the flat batch position (0 where absent), whether the token is a
    real (non-padding) one, and whether it is a batch token at all (not a backend's padding)."""
    f = field.reshape(-1)
    return (f.abs() - 1).clamp(min=0), f > 0, f != 0


def check_record(
    record: Any, batch: Mapping[str, Tensor], layers: int, top_k: int, experts: int, where: str
) -> None:
    """Refuse a routing record that does not fit `batch` and the model, before any compute:
    ``TypeError`` unless it is an integer tensor, ``ValueError`` unless it is ``[B, T, layers,
    top_k]`` for `batch`'s ``[B, T]`` with `top_k` different experts in ``[0, experts)`` for
    every non-padding token (values checked on the host only; padding tokens are routed by
    the router itself)."""
    if not isinstance(record, Tensor) or record.is_floating_point() or record.dtype == torch.bool:
        raise TypeError(
            f"{where}: batch[{ROUTED_EXPERTS!r}] must be an integer tensor [B, T, moe_layers, "
            f"top_k] as tf.token_logps(..., record_routing=True) returns, got "
            f"{getattr(record, 'dtype', type(record).__name__)}"
        )
    want = (*batch["input_ids"].shape, layers, top_k)
    if tuple(record.shape) != want:
        raise ValueError(
            f"{where}: batch[{ROUTED_EXPERTS!r}] has shape {tuple(record.shape)}, this batch "
            f"and model need {want} ([B, T, moe_layers, top_k]); record it on the same batch "
            "with tf.token_logps(..., record_routing=True)"
        )
    mask = batch.get("attention_mask")
    if record.device.type == "cpu" and record.numel():
        real = record if mask is None or "cu_seqlens" in batch else record[mask.bool().cpu()]
        if not real.numel():
            return
        lo, hi = int(real.min()), int(real.max())
        if lo < 0 or hi >= experts:
            raise ValueError(
                f"{where}: batch[{ROUTED_EXPERTS!r}] holds experts {lo}..{hi}, outside the "
                f"model's 0..{experts - 1}"
            )
        ordered = real.sort(-1).values
        if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
            raise ValueError(
                f"{where}: batch[{ROUTED_EXPERTS!r}] lists an expert twice for a token; each "
                f"token's {top_k} experts must differ"
            )


def replay_targets(record: Tensor, index: Tensor) -> Tensor:
    """``[L, n, k]`` int64: the recorded experts of the batch positions `index` ``[n]``, from
    `record` ``[B, T, L, k]``."""
    flat = record.reshape(-1, *record.shape[-2:]).to(index.device)
    return flat[index].permute(1, 0, 2).long()


def record_part(rp: RouterPass, tokens: Tensor, present: Tensor, index: Tensor) -> Tensor:
    """This rank's part of a routing record: ``[tokens, L, k]`` int64 holding ``expert + 1`` at
    the batch positions `index` ``[n]`` where `present` (what `rp` recorded for them, in the
    order observed, micro-batches concatenated), 0 elsewhere; summing the parts of ranks that
    hold different tokens and subtracting 1 gives the record (see `RouterPass`)."""
    layers = [torch.cat(rp.recorded[i]) for i in range(rp.num_layers)]
    got = torch.stack(layers, 1) + 1  # [n, L, k]
    out = torch.zeros(tokens, rp.num_layers, rp.top_k, dtype=torch.int64, device=got.device)
    keep = present.to(got.device)
    out[index.to(got.device)[keep]] = got[keep].long()
    return out


def with_token_field(config: Any, batch: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    """`batch` plus `ROUTER_TOKEN` (`token_field`) for a model of an MoE family, after checking
    a routing record it carries (`check_record`); `batch` itself for a dense model. Raises
    ``ValueError`` for a record on a dense model, and as `check_record` does."""
    moe = family(config).moe
    if moe is None:
        if ROUTED_EXPERTS in batch:
            raise ValueError(
                f"batch[{ROUTED_EXPERTS!r}] replays MoE routing, but this "
                f"{getattr(config, 'model_type', '?')} model is dense; drop the field"
            )
        return batch
    if ROUTED_EXPERTS in batch:
        check_record(
            batch[ROUTED_EXPERTS],
            batch,
            len(family(config).moe_layers(config)),
            getattr(config, moe.top_k),
            getattr(config, moe.num_experts),
            "routing replay",
        )
    return {**batch, ROUTER_TOKEN: token_field(batch)}
