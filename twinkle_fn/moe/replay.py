"""Routing replay: recording which experts each token was routed to, and routing a batch
through a record again.

A record (`ROUTED_EXPERTS`) is ``[B, T, L, k]`` int64 in the batch's own
layout (``[1, T, L, k]`` for a packed row): each token's ``k`` experts per MoE layer, sorted
ascending. ``tf.token_logps(..., record_routing=True)`` returns it; a batch carrying it under
``"routed_experts"`` makes ``tf.fwd_bwd`` / ``tf.token_logps`` route every non-padding token to
those experts (its routing weights recomputed from the current router for them; padding keeps
the router's own choice).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from twinkle_fn.models.families import family
from twinkle_fn.moe.router_pass import RouterPass

ROUTED_EXPERTS = "routed_experts"
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
