"""Small, deterministic models and data for tests (no download, seconds on a CPU)."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

_BASE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
_EXTRA: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {},
    "qwen3": {"head_dim": 8},
    "qwen3_moe": {
        "head_dim": 8,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "decoder_sparse_step": 1,
    },
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32,
        "decoder_sparse_step": 1,
    },
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 16},
    # one dense layer then one MoE layer; 2 groups of 2 experts, one group per token (a
    # group's score is its top-2 sum, which megatron matches when top_k // topk_group == 2);
    # half of each head rotated
    "glm4_moe": {
        "head_dim": 8,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 1.5,
    },
    # multi-latent attention with a query down projection (q_lora_rank; None gives q_proj);
    # as many kv heads as heads (HF's MLA expands keys to every head); router as glm4_moe's
    "deepseek_v3": {
        "num_key_value_heads": 4,
        "q_lora_rank": 16,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 1.5,
    },
    # a Gated DeltaNet layer, then a full attention layer (every second layer attends fully)
    "qwen3_5_text": {
        "head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "full_attention_interval": 2,
    },
    # qwen3_5_text's two layers, each with 4 routed experts (2 per token) and a shared expert
    "qwen3_5_moe_text": {
        "head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "full_attention_interval": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32,
    },
    # sliding and global layers alternate; a window shorter than the test sequences
    "gemma3_text": {
        "head_dim": 8,
        "query_pre_attn_scalar": 8,
        "sliding_window": 4,
        "sliding_window_pattern": 2,
    },
}


def tiny_config(family: str = "qwen2", **overrides: Any) -> PretrainedConfig:
    """A 2-layer config of `family` with hidden size 32 and a 96-token vocabulary."""
    if family not in _EXTRA:
        raise ValueError(f"no tiny config for family {family!r}; known: {', '.join(_EXTRA)}")
    return AutoConfig.for_model(family, **{**_BASE, **_EXTRA[family], **overrides})


def random_features(
    n: int, *, vocab_size: int = 96, min_len: int = 3, max_len: int = 12, seed: int = 0
) -> list[dict[str, list[int]]]:
    """`n` features of random tokens with shifted labels; about a third of each prompt is masked.

    Every feature has at least one supervised token (the masked prompt is under a third).
    """
    rng = random.Random(seed)
    feats = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        ids = [rng.randrange(1, vocab_size) for _ in range(length)]
        prompt = rng.randint(0, length // 3)
        raw = [-100] * prompt + ids[prompt:]
        feats.append({"input_ids": ids, "labels": [*raw[1:], -100]})
    return feats


def policy_gradient_reference(
    module: torch.nn.Module, features: list[dict[str, Any]], entropy_coef: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`twinkle_fn.losses.policy_gradient`'s loss sum over `features` (with ``advantages``) and
    its gradients by parameter name, written out over a plain forward of `module` on the
    right-padded batch, in the module's dtype (float64 for a reference)."""
    ids, labels, advantages, mask, positions = (
        torch.zeros(len(features), max(len(f["input_ids"]) for f in features), dtype=dtype)
        for dtype in (torch.int64, torch.int64, torch.float64, torch.int64, torch.int64)
    )
    labels.fill_(-100)
    for row, f in enumerate(features):
        n = len(f["input_ids"])
        ids[row, :n], labels[row, :n] = torch.tensor(f["input_ids"]), torch.tensor(f["labels"])
        advantages[row, :n] = torch.tensor(f["advantages"], dtype=torch.float64)
        mask[row, :n], positions[row, :n] = 1, torch.arange(n)
    logits = module(
        input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False
    ).logits  # [B, T, V]
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [B, T]
    entropy = -(logp.exp() * logp).sum(-1)  # [B, T]
    terms = -(advantages.to(logp.dtype) * picked) - entropy_coef * entropy
    loss_sum = (terms * (labels != -100)).sum()
    params = dict(module.named_parameters())
    grads = torch.autograd.grad(loss_sum, list(params.values()))
    return loss_sum.detach(), dict(zip(params, grads, strict=True))


def with_advantages(features: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """`features`, each with per-token ``advantages`` in ``[-1, 1)`` (the batch field of
    `twinkle_fn.losses.policy_gradient`); the inputs are not modified. Multiples of 1/1024, so
    that float32 (collation's dtype for floats) holds them exactly."""
    rng = random.Random(seed)
    return [
        {**f, "advantages": [rng.randrange(-1024, 1024) / 1024 for _ in f["input_ids"]]}
        for f in features
    ]


def run_triton_interpreted(code: str, *args: str) -> None:
    """Run Python `code` (with `args` as ``sys.argv[1:]``) in a fresh process under Triton's CPU
    interpreter, so a kernel's logic is tested without a GPU.

    A fresh process because ``TRITON_INTERPRET`` must be set before triton is first imported.
    Raises ``AssertionError`` with the end of the child's stderr if it fails.
    """
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=os.environ | {"TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def assert_within_float8_rounding(reference: Sequence[float], losses: Sequence[float]) -> None:
    """Check a float8 run's per-step `losses` against the float32 run's `reference`: each step
    within 1% relative (float8 rounding of the GEMM operands, as the fp8 tests measure it), and
    some step more than 1e-6 apart (more than float32 rounding: the float8 path ran).

    Raises ``AssertionError`` naming the step when a bound fails, ``ValueError`` when the runs
    have different lengths.
    """
    for step, (a, b) in enumerate(zip(reference, losses, strict=True)):
        assert abs(a - b) <= 1e-2 * abs(a), f"step {step}: loss {b}, float32 {a}: over 1% apart"
    gap = max(abs(a - b) for a, b in zip(reference, losses, strict=True))
    assert gap > 1e-6, f"the losses are {gap} apart at most: the float8 path did not run"


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Within the block, a CUDA call that makes the host wait for the device raises
    ``RuntimeError`` (``torch.cuda.set_sync_debug_mode("error")``); the device's queue is
    drained first, so only the block's own waits count. CUDA only."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def ppo_reference_terms(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    fields: dict[str, torch.Tensor],
    loss: Any,
) -> torch.Tensor:
    """The per-token terms of `twinkle_fn.losses.ppo_loss` `loss`, written out piecewise (which
    branch of the clipped surrogate is active) rather than as a max, in `logp`'s dtype.
    `logp`, `entropy` and each field ``[B, T]``; returns ``[B, T]`` (unmasked)."""
    f = {k: v.to(logp.dtype) for k, v in fields.items()}
    adv, ratio = f["advantages"], torch.exp(logp - f["old_logps"])
    high, low = 1 + loss.epsilon_high, 1 - loss.epsilon
    # the clip binds where it lowers the objective: a good token pushed above 1 + eps_high,
    # a bad one below 1 - eps; there the term is a constant (no gradient)
    binds = ((adv > 0) & (ratio > high)) | ((adv < 0) & (ratio < low))
    bound = torch.where(adv > 0, torch.full_like(ratio, high), torch.full_like(ratio, low))
    terms = torch.where(binds, -adv * bound, -adv * ratio)
    if loss.tis_cap is not None:
        terms = terms * torch.clamp(
            torch.exp(f["old_logps"] - f["rollout_logps"]), max=loss.tis_cap
        )
    if loss.beta:
        if loss.kl_estimator == "k1":
            kl = logp - f["ref_logps"]
        else:
            kl = torch.exp(f["ref_logps"] - logp) - (f["ref_logps"] - logp) - 1
        terms = terms + loss.beta * kl
    terms = terms - loss.entropy_coef * entropy
    if loss.aggregation != "token_mean":
        terms = terms * f["loss_weights"]
    return terms


def ppo_reference(
    module: torch.nn.Module, features: list[dict[str, Any]], loss: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`ppo_reference_terms`' loss sum over `features` (carrying `loss.fields`, per token or per
    sample) and its gradients by parameter name, over a plain forward of `module` on the
    right-padded batch, in the module's dtype (float64 for a reference)."""
    logp_all, labels, fields = _reference_forward(module, features, loss.fields)
    logp = logp_all.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [B, T]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [B, T]
    supervised = labels != -100
    terms = ppo_reference_terms(logp, entropy, fields, loss)
    return _with_grads(module, torch.where(supervised, terms, 0.0).sum())


def _reference_forward(
    module: torch.nn.Module, features: list[dict[str, Any]], names: Any
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """A plain forward of `module` on `features` right-padded: the log-softmax ``[B, T, V]``
    (module's dtype), labels ``[B, T]`` (-100 on padding) and the fields `names` ``[B, T]``
    float64 (a per-sample number repeated over the sample's tokens, 0 on padding)."""
    logits, labels, fields = _plain_forward(module, features, names)  # [B, T, V]
    return torch.log_softmax(logits, dim=-1), labels, fields


def _plain_forward(
    module: torch.nn.Module, features: list[dict[str, Any]], names: Any
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """`module`'s output ``logits`` on `features` right-padded, with labels and fields as
    `_reference_forward` returns them."""
    width = max(len(f["input_ids"]) for f in features)
    ids, labels, mask, positions = (
        torch.zeros(len(features), width, dtype=torch.int64) for _ in range(4)
    )
    labels.fill_(-100)
    fields = {name: torch.zeros(len(features), width, dtype=torch.float64) for name in names}
    for row, f in enumerate(features):
        n = len(f["input_ids"])
        ids[row, :n], labels[row, :n] = torch.tensor(f["input_ids"]), torch.tensor(f["labels"])
        mask[row, :n], positions[row, :n] = 1, torch.arange(n)
        for name in names:
            fields[name][row, :n] = torch.as_tensor(f[name], dtype=torch.float64)
    logits = module(
        input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False
    ).logits  # [B, T, V]
    return logits, labels, fields


def value_reference(
    module: torch.nn.Module, features: list[dict[str, Any]], clip: float | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`twinkle_fn.losses.value_loss`'s loss sum over `features` (with ``returns`` and
    ``old_values``) for a value model `module` (``[hidden] -> 1`` head), written out piecewise
    (clipped branch or not), and its gradients by parameter name, over a plain forward on the
    right-padded batch in the module's dtype (float64 for a reference)."""
    scores, labels, fields = _plain_forward(module, features, ("returns", "old_values"))
    return _with_grads(module, value_reference_sum(scores[..., 0], labels, fields, clip))


def value_reference_sum(
    values: torch.Tensor, labels: torch.Tensor, fields: dict[str, torch.Tensor], clip: float | None
) -> torch.Tensor:
    """The clipped value loss of `values` ``[B, T]`` summed over the tokens whose label is not
    -100, branch by branch: the clipped error counts only where the value left
    ``old_values +- clip`` and the clipped error is the larger."""
    returns = fields["returns"].to(values.dtype)
    error = (values - returns) ** 2
    if clip is not None:
        old = fields["old_values"].to(values.dtype)
        low, high = old - clip, old + clip
        bound = torch.where(values > high, high, low)
        outside = (values > high) | (values < low)
        clipped_error = (bound - returns) ** 2
        error = torch.where(outside & (clipped_error > error), clipped_error, error)
    return 0.5 * torch.where(labels != -100, error, 0.0).sum()


def with_value_fields(features: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """`features` (not modified) with per-token ``returns`` in ``[-1, 1)`` and ``old_values``
    within 0.375 of a tiny random critic's values (about 0 +- 0.3), so that a clip of 0.2 binds on
    some tokens only. Multiples of 1/1024: exact in float32 (collation's dtype)."""
    rng = random.Random(seed)
    return [
        {
            **f,
            "returns": [rng.randrange(-1024, 1024) / 1024 for _ in f["input_ids"]],
            "old_values": [rng.randrange(-384, 384) / 1024 for _ in f["input_ids"]],
        }
        for f in features
    ]


def _with_grads(
    module: torch.nn.Module, loss: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`loss` detached and its gradients by parameter name of `module`."""
    params = dict(module.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()))
    return loss.detach(), dict(zip(params, grads, strict=True))


def preference_reference_losses(
    sums: torch.Tensor, lengths: torch.Tensor, ref: torch.Tensor | None, loss: Any
) -> torch.Tensor:
    """The pair losses of `twinkle_fn.losses.dpo_loss` / `simpo_loss` `loss`, written out with
    ``log(sigmoid(.))``: `sums`, `lengths` and `ref` (DPO only) ``[2P]`` per sequence,
    interleaved chosen / rejected; returns ``[P]``."""
    if loss.kind == "simpo":
        margin = loss.beta * (sums[0::2] / lengths[0::2] - sums[1::2] / lengths[1::2])
        return -torch.log(torch.sigmoid(margin - loss.gamma))
    chosen, rejected = sums[0::2] - ref[0::2], sums[1::2] - ref[1::2]
    z = loss.beta * (chosen - rejected)
    eps = loss.label_smoothing
    return -(1 - eps) * torch.log(torch.sigmoid(z)) - eps * torch.log(torch.sigmoid(-z))


def preference_reference(
    module: torch.nn.Module, features: list[dict[str, Any]], loss: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The sum over pairs of `preference_reference_losses` for `features` (interleaved chosen /
    rejected, with ``ref_logps`` per token or ``ref_seq_logps`` per sample as `loss` reads)
    and its gradients by parameter name, over a plain forward of `module` on the right-padded
    batch, in the module's dtype (float64 for a reference)."""
    logp_all, labels, fields = _reference_forward(module, features, loss.fields)
    supervised = labels != -100
    logp = logp_all.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [B, T]
    sums = torch.where(supervised, logp, 0.0).sum(-1)  # [B]
    lengths = supervised.sum(-1).to(sums.dtype)  # [B]
    ref = None
    if "ref_logps" in fields:
        ref = torch.where(supervised, fields["ref_logps"], 0.0).sum(-1)
    elif "ref_seq_logps" in fields:
        ref = fields["ref_seq_logps"][:, 0]
    return _with_grads(module, preference_reference_losses(sums, lengths, ref, loss).sum())


def with_rl_fields(features: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """`features` (not modified) with every field `twinkle_fn.losses.ppo_loss` may read: per-token
    ``advantages`` in ``[-1, 1)``; ``old_logps``, ``ref_logps`` and ``rollout_logps`` in
    ``[-5.5, -3.5)``, around a tiny random model's ``log(1/96)`` so that the clip binds on some
    tokens only; a per-sample ``loss_weights`` of `aggregation_weights`' sequence mean. All
    exact in float32 (collation's dtype), so float64 references see the same numbers."""
    from twinkle_fn.losses import aggregation_weights

    rng = random.Random(seed)
    lengths = [sum(x != -100 for x in f["labels"]) for f in features]
    weights = aggregation_weights(lengths, "seq_mean_token_mean")

    def logps(n: int) -> list[float]:
        return [rng.randrange(-1408, -896) / 256 for _ in range(n)]

    return [
        {
            **f,
            "advantages": [rng.randrange(-1024, 1024) / 1024 for _ in f["input_ids"]],
            "old_logps": logps(len(f["input_ids"])),
            "ref_logps": logps(len(f["input_ids"])),
            "rollout_logps": logps(len(f["input_ids"])),
            "loss_weights": float(torch.tensor(w, dtype=torch.float32)),
        }
        for f, w in zip(features, weights, strict=True)
    ]


def with_loss_scale(features: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """`features` (not modified) with a per-token ``loss_scale`` in ``{0, 0.25, ..., 2}`` (zeros
    included; exact in float32, collation's dtype)."""
    rng = random.Random(seed)
    return [{**f, "loss_scale": [rng.randrange(9) / 4 for _ in f["input_ids"]]} for f in features]


def weighted_ce_reference(
    module: torch.nn.Module, features: list[dict[str, Any]]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`twinkle_fn.losses.weighted_cross_entropy`'s loss sum over `features` (with
    ``loss_scale``), ``-sum loss_scale * log p(label)`` over supervised tokens, and its
    gradients by parameter name, over a plain forward of `module` on the right-padded batch,
    in the module's dtype (float64 for a reference)."""
    logp_all, labels, fields = _reference_forward(module, features, ("loss_scale",))
    logp = logp_all.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [B, T]
    terms = -(fields["loss_scale"].to(logp.dtype) * logp)
    return _with_grads(module, torch.where(labels != -100, terms, 0.0).sum())


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
