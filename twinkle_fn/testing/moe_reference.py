"""A reference for the mixture-of-experts router losses (`twinkle_fn.moe`): a plain HF forward
of an MoE module with the load-balancing and z losses written straight from transformers' and
megatron-core's formulas, their gradients, and the expert load each router chose.
"""

from __future__ import annotations

from typing import Any

import torch


def router_reference(
    module: torch.nn.Module,
    features: list[dict[str, Any]],
    *,
    aux_coef: float,
    aux_kind: str,
    z_coef: float,
) -> dict[str, Any]:
    """A plain forward of the HF MoE `module` on `features` right-padded, and the loss the
    router losses train, written straight from transformers' and megatron-core's formulas:
    ``ce_sum + N * (aux_coef * aux + z_coef * z)``, ``N`` the supervised tokens, over the
    non-padding tokens. ``"hf"``: transformers' ``load_balancing_loss_func`` over every layer's
    softmax scores at once and the z-loss as the mean over every layer's tokens; ``"megatron"``:
    ``switch_load_balancing_loss_func`` per layer (softmax scores), summed, and the per-layer
    z-loss means, summed. Returns ``loss`` (the token sum), ``aux``, ``z``, ``num_tokens``,
    ``grads`` by parameter name, and ``load`` ``[L, E]`` int64: the tokens each HF router
    routed to each expert (its own top-k), padding excluded."""
    picked: list[torch.Tensor] = []
    routers = _routers(module)
    hooks = [r.register_forward_hook(lambda _m, _a, out: picked.append(out[2])) for r in routers]
    try:
        width = max(len(f["input_ids"]) for f in features)
        ids = torch.zeros(len(features), width, dtype=torch.int64)
        labels = torch.full_like(ids, -100)
        mask = torch.zeros_like(ids)
        for row, f in enumerate(features):
            n = len(f["input_ids"])
            ids[row, :n], labels[row, :n] = torch.tensor(f["input_ids"]), torch.tensor(f["labels"])
            mask[row, :n] = 1
        out = module(input_ids=ids, attention_mask=mask, output_router_logits=True)
    finally:
        for h in hooks:
            h.remove()
    logits = out.logits.reshape(-1, out.logits.shape[-1])
    ce = torch.nn.functional.cross_entropy(
        logits, labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    valid = mask.reshape(-1).bool()
    num = int((labels != -100).sum())
    layers = [x[valid] for x in out.router_logits]  # [T, E] each, padding dropped
    k = len(picked[0][0])
    tokens, experts = layers[0].shape
    if aux_kind == "hf":
        probs = torch.softmax(torch.cat(layers), -1)  # [L * T, E]
        chosen = torch.zeros_like(probs).scatter(1, probs.topk(k, -1).indices, 1.0)
        aux = experts * (chosen.mean(0) * probs.mean(0)).sum()
        z = torch.logsumexp(torch.cat(layers), -1).square().mean()
    else:
        aux, z = 0.0, 0.0
        for x in layers:
            probs = torch.softmax(x, -1)
            chosen = torch.zeros_like(probs).scatter(1, probs.topk(k, -1).indices, 1.0)
            aux = aux + experts / (k * tokens**2) * (chosen.sum(0) * probs.sum(0)).sum()
            z = z + torch.logsumexp(x, -1).square().mean()
    loss = ce + num * (aux_coef * aux + z_coef * z)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    load = torch.stack(
        [torch.bincount(idx[valid].reshape(-1), minlength=experts) for idx in picked]
    )
    return {
        "loss": loss.detach(),
        "aux": torch.as_tensor(aux).detach(),
        "z": torch.as_tensor(z).detach(),
        "num_tokens": num,
        "grads": grads,
        "load": load,
    }


def _routers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The HF MoE routers of `module` in layer order (the class it records router logits of)."""
    for m in module.modules():
        rec = getattr(type(m), "_can_record_outputs", None) or {}
        if "router_logits" in rec:
            target = rec["router_logits"].target_class
            return [r for r in module.modules() if isinstance(r, target)]
    raise ValueError("the module records no router logits: not an MoE model")
