"""Tests of `twinkle_fn.moe.losses`: the formulas against transformers' and megatron-core's own,
and the `router_loss` option."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func, z_loss_func
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from twinkle_fn.moe.losses import (
    RouterLoss,
    load_balancing_loss,
    router_loss,
    router_terms,
    z_loss,
)
from twinkle_fn.testing import tiny_config

L, N, E, K = 3, 10, 6, 2


def _logits(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, N, E, generator=g, dtype=torch.float64)


def _stats(logits: torch.Tensor, valid: torch.Tensor | None, score: str = "softmax"):
    terms = [router_terms(x, valid, K, score) for x in logits]
    return tuple(torch.stack(t) for t in zip(*terms, strict=True))


@pytest.mark.parametrize("masked", [False, True])
def test_hf_aux_equals_transformers(masked: bool) -> None:
    # float64 inputs through transformers' function (which accumulates in float32): 1e-6
    logits = _logits()
    mask = torch.ones(2, N // 2, dtype=torch.long)
    if masked:
        mask[0, -2:] = 0
        mask[1, -1:] = 0
    valid = mask.reshape(-1).bool() if masked else None
    counts, probs, _ = _stats(logits, valid)
    ours = load_balancing_loss(counts, probs, mask.sum() if masked else N, K, "hf")
    theirs = load_balancing_loss_func(tuple(logits), E, K, mask if masked else None)
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=1e-6, atol=1e-7)


def test_megatron_aux_and_z_equal_megatron_core() -> None:
    # megatron-core's per-layer functions summed over layers, float64 both sides: 1e-12
    logits = _logits(1)
    valid = torch.ones(N, dtype=torch.bool)
    valid[-3:] = False
    counts, probs, lse = _stats(logits, valid)
    t = int(valid.sum())
    ref_aux = sum(
        switch_load_balancing_loss_func(torch.softmax(x, -1) * valid[:, None], c, t, K, E, 1.0)
        for x, c in zip(logits, counts, strict=True)
    )
    ref_z = sum(z_loss_func(x, 1.0, padding_mask=~valid) for x in logits)
    torch.testing.assert_close(load_balancing_loss(counts, probs, t, K, "megatron"), ref_aux)
    torch.testing.assert_close(z_loss(lse, t, "megatron"), ref_z)
    # hf's z-loss is the mean over every layer's tokens
    ref_hf = torch.logsumexp(logits, -1)[:, valid].square().mean()
    torch.testing.assert_close(z_loss(lse, t, "hf"), ref_hf)


def test_one_layer_hf_is_k_times_megatron() -> None:
    counts, probs, _ = _stats(_logits(2)[:1], None)
    hf = load_balancing_loss(counts, probs, N, K, "hf")
    torch.testing.assert_close(hf, K * load_balancing_loss(counts, probs, N, K, "megatron"))


def test_router_loss_option() -> None:
    cfg = tiny_config("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.02)
    assert router_loss({}, cfg) == RouterLoss(0.02, "hf", 0.0)
    assert router_loss({}, tiny_config("qwen3_moe")) == RouterLoss()
    opt = {"router_loss": {"aux_coef": 0.1, "aux_kind": "megatron", "z_coef": 1e-3}}
    assert router_loss(opt, cfg) == RouterLoss(0.1, "megatron", 1e-3)
    with pytest.raises(ValueError, match="aux_kind must be one of"):
        router_loss({"router_loss": {"aux_kind": "switch"}}, cfg)
    with pytest.raises(ValueError, match="z_coef must be a finite number >= 0, got -1"):
        router_loss({"router_loss": {"z_coef": -1}}, cfg)
    with pytest.raises(ValueError, match="unknown field"):
        router_loss({"router_loss": {"coef": 0.1}}, cfg)
    with pytest.raises(TypeError, match="RouterLoss or a dict"):
        router_loss({"router_loss": 0.1}, cfg)
