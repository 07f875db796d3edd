"""Per-token log-probabilities on the transformers backend, for rollouts' old and reference
log-probs and evaluation: the lm_head in terms mode (chunked, no ``[B, T, V]`` logits), or a
plain forward's logits when they are asked for or a temperature other than 1 needs the cross
entropy at temperature 1 as well."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

from twinkle_fn.backends.transformers import router
from twinkle_fn.backends.transformers.compute import autocast, bind, model_inputs
from twinkle_fn.backends.transformers.lm_head import terms_mode
from twinkle_fn.backends.transformers.lora import adapters_off
from twinkle_fn.data import IGNORE_INDEX
from twinkle_fn.losses import supervised_rows
from twinkle_fn.losses import token_logps as logps_of_logits
from twinkle_fn.moe import ROUTED_EXPERTS, with_token_field
from twinkle_fn.state import TrainState


def token_logps(
    state: TrainState,
    batch: Mapping[str, torch.Tensor],
    temperature: float,
    disable_lora: bool,
    return_logits: bool,
    record_routing: bool = False,
) -> dict[str, torch.Tensor]:
    """``logps`` ``[B, T]`` of `batch`'s labels under ``softmax(logits / temperature)``, 0
    where the label is -100; ``loss_sum`` (the cross entropy at temperature 1, summed) and
    ``num_tokens``; ``logits`` ``[B, T, V]`` (divided by `temperature`) when asked; with
    `record_routing` ``routed_experts`` ``[B, T, moe_layers, top_k]`` (`twinkle_fn.moe`).

    `disable_lora` computes with the base weights only. An MoE model replays
    ``batch["routed_experts"]`` when present. No gradient is taken; the caller releases what
    FSDP2 gathered for the forward.
    """
    model = state.model
    batch = with_token_field(model.config, batch)
    rp = router.new_pass(model, record=True) if record_routing else None
    with router.routing(model, rp, batch):
        out = _token_logps(state, batch, temperature, disable_lora, return_logits)
    if rp is not None:
        out[ROUTED_EXPERTS] = router.recorded(rp, batch)
    return out


def _token_logps(
    state: TrainState,
    batch: Mapping[str, torch.Tensor],
    temperature: float,
    disable_lora: bool,
    return_logits: bool,
) -> dict[str, torch.Tensor]:
    model = state.model
    bind(model.module, state.params, sharded=model.placement is not None)
    device = model.device
    labels = batch["labels"].to(device)  # [B, T], already shifted
    off = adapters_off(model.module) if disable_lora else contextlib.nullcontext()
    num_tokens = (labels != IGNORE_INDEX).sum()
    if temperature == 1.0 and not return_logits:
        rows = supervised_rows(batch["labels"], IGNORE_INDEX, device)  # [supervised tokens]
        head = model.module.get_output_embeddings()
        with torch.no_grad(), autocast(model), off, terms_mode(head, labels, rows):
            inputs = model_inputs(batch, device, model.config)
            logps = model.module(**inputs, use_cache=False).logits[..., 0]  # [B, T]
        return {"num_tokens": num_tokens, "logps": logps, "loss_sum": -logps.sum()}
    with torch.no_grad(), autocast(model), off:
        inputs = model_inputs(batch, device, model.config)
        logits = model.module(**inputs, use_cache=False).logits  # [B, T, V]
    out = {"num_tokens": num_tokens, "loss_sum": -logps_of_logits(logits, labels).sum()}
    if temperature != 1.0:
        logits = logits / temperature
    out["logps"] = logps_of_logits(logits, labels)
    if return_logits:
        out["logits"] = logits
    return out
