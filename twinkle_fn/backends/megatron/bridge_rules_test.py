import pytest

from twinkle_fn.backends.megatron.bridge_rules import EMBEDDING, Rule, moe_layers, rules_for
from twinkle_fn.testing import tiny_config


def test_rules_are_data_per_family():
    llama = rules_for(tiny_config("llama"))
    assert llama[0] == EMBEDDING
    assert {r.transform for r in llama} == {"vocab", "copy", "qkv", "gate_up"}
    assert [r.mcore for r in rules_for(tiny_config("qwen2"))][3] == (
        "decoder.layers.{layer}.self_attention.linear_qkv.bias"
    )
    moe = [r for r in rules_for(tiny_config("qwen3_moe")) if r.expert]
    assert [r.hf[0] for r in moe] == [
        "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
        "model.layers.{layer}.mlp.experts.{expert}.down_proj.weight",
    ]
    assert moe_layers(tiny_config("qwen3_moe", mlp_only_layers=[0])) == (False, True)
    assert moe_layers(tiny_config("qwen3_moe", decoder_sparse_step=2)) == (False, True)


def test_rule_validates_its_fields():
    with pytest.raises(ValueError, match="transform 'qkv' takes 3 HF names"):
        Rule(("a",), "b", "qkv", 0)
    with pytest.raises(ValueError, match="not one of"):
        Rule(("a",), "b", "rotate", None)
    with pytest.raises(ValueError, match="stage"):
        Rule(("a",), "b", "copy", None, stage="middle")
