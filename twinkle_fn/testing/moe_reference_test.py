"""`router_reference` on a tiny float64 Qwen3-MoE whose routers are zeroed: every expert scores
alike, so both aux-loss definitions and the z-loss have closed forms, and the recorded load
counts k experts per non-padding token."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from twinkle_fn.testing.configs import tiny_config
from twinkle_fn.testing.features import random_features
from twinkle_fn.testing.moe_reference import router_reference

EXPERTS, TOP_K, LAYERS = 4, 2, 2  # tiny_config("qwen3_moe")


@pytest.fixture(scope="module")
def uniform_moe():
    config = tiny_config("qwen3_moe")
    config._experts_implementation = "eager"  # transformers' grouped GEMM has no float64
    torch.manual_seed(0)
    module = AutoModelForCausalLM.from_config(config).to(torch.float64)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.zero_()
    return module


@pytest.mark.parametrize("kind", ["hf", "megatron"])
def test_uniform_routers_give_the_closed_form_losses_and_k_experts_per_token(uniform_moe, kind):
    feats = random_features(3, seed=2)  # unequal lengths: the padding must not count
    out = router_reference(uniform_moe, feats, aux_coef=0.5, aux_kind=kind, z_coef=0.1)
    # hf: E * sum_e(share_e / E) = k over all layers at once; megatron: 1 per layer, summed
    aux, z = (
        (TOP_K, math.log(EXPERTS) ** 2) if kind == "hf" else (LAYERS, LAYERS * math.log(4) ** 2)
    )
    assert abs(float(out["aux"]) - aux) < 1e-12 and abs(float(out["z"]) - z) < 1e-12
    tokens = sum(len(f["input_ids"]) for f in feats)
    assert out["load"].shape == (LAYERS, EXPERTS)
    assert out["load"].sum(-1).tolist() == [TOP_K * tokens] * LAYERS
    assert out["num_tokens"] == sum(x != -100 for f in feats for x in f["labels"])
    assert all(p.grad is None for p in uniform_moe.parameters())  # the grads were handed back
    assert out["grads"].keys() == dict(uniform_moe.named_parameters()).keys()


def test_a_dense_model_is_refused():
    dense = AutoModelForCausalLM.from_config(tiny_config("qwen3"))
    with pytest.raises(ValueError, match="not an MoE model"):
        router_reference(dense, random_features(1), aux_coef=0.0, aux_kind="hf", z_coef=0.0)
