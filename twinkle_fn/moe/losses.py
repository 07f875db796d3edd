"""The router losses of mixture-of-experts models, defined once for every backend.

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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

AUX_KINDS = ("hf", "megatron")
ROUTER_LOSS_OPTION = "router_loss"


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
