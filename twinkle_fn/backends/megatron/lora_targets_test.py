"""twinkle_fn/backends/megatron/lora_targets.py: peft's targets resolve to megatron's linears in
HF names, and configs this LoRA cannot train are refused with the fix (on meta-device HF
models: no compute)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from twinkle_fn.backends.megatron import lora as mlora
from twinkle_fn.backends.megatron.lora_test import CFG, HF_LINEARS
from twinkle_fn.testing import tiny_config


@pytest.fixture(scope="module")
def hf_skeleton():
    with torch.device("meta"):
        return {
            family: AutoModelForCausalLM.from_config(tiny_config(family))
            for family in ("qwen2", "qwen3_moe")
        }


def test_targets_resolve_in_hf_names(hf_skeleton):
    qwen2, moe = hf_skeleton["qwen2"], hf_skeleton["qwen3_moe"]
    plan = mlora.resolve(CFG, qwen2)
    assert plan.layers == {0: tuple(mlora.LINEARS), 1: tuple(mlora.LINEARS)}
    assert plan.config.target_modules == set(HF_LINEARS)
    attention = ("self_attention.linear_qkv", "self_attention.linear_proj")
    assert mlora.resolve({**CFG, "target_modules": "all-linear"}, moe).layers == {
        0: attention,
        1: attention,
    }
    some = {"target_modules": ["q_proj", "k_proj", "v_proj", "down_proj"], "layers_to_transform": 1}
    assert mlora.resolve(some, qwen2).layers == {1: ("self_attention.linear_qkv", "mlp.linear_fc2")}
    excluded = {**CFG, "exclude_modules": ["o_proj"]}
    assert "self_attention.linear_proj" not in mlora.resolve(excluded, qwen2).layers[0]


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({**CFG, "target_modules": ["q_proj"]}, r"add \['k_proj', 'v_proj'\]"),
        ({**CFG, "target_modules": ["gate_proj", "down_proj"]}, r"add \['up_proj'\]"),
        ({**CFG, "target_modules": ["q_proj", "k_proj", "v_proj", "lm_head"]}, "cannot adapt"),
        ({**CFG, "target_modules": ["embed_tokens"]}, "cannot adapt"),
        ({**CFG, "target_modules": ["no_such_proj"]}, "matches no linear layer"),
        ({**CFG, "target_modules": None}, "target_modules is None"),
        ({**CFG, "use_dora": True}, "use_dora"),
        ({**CFG, "bias": "all"}, "bias='all'"),
        ({**CFG, "rank_pattern": {"q_proj": 8}}, "rank_pattern"),
        ({**CFG, "init_lora_weights": "pissa"}, "rewrites the base weights"),
    ],
)
def test_bad_configs_are_refused_with_the_fix(hf_skeleton, config, match):
    with pytest.raises(ValueError, match=match):
        mlora.resolve(config, hf_skeleton["qwen2"])
