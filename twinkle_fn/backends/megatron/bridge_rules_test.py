import pytest
import torch
from transformers import AutoModelForCausalLM

from twinkle_fn.backends.megatron.bridge import hf_to_mcore, mcore_to_hf
from twinkle_fn.backends.megatron.bridge_rules import (
    EMBEDDING,
    VALUE_BIAS,
    VALUE_HEAD,
    Rule,
    moe_layers,
    rules_for,
)
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


def test_shared_experts_and_checkpoint_names_other_than_in_memory():
    """Qwen2-MoE's shared expert (split like a dense MLP, its gate whole); Mixtral's experts as
    its checkpoints name them (``block_sparse_moe``, w1 = gate, w3 = up, w2 = down)."""
    shared = {r.mcore: r for r in rules_for(tiny_config("qwen2_moe")) if "shared" in r.mcore}
    prefix = "decoder.layers.{layer}.mlp.shared_experts."
    fc1, fc2, gate = (
        shared[prefix + n] for n in ("linear_fc1.weight", "linear_fc2.weight", "gate_weight")
    )
    assert fc1.hf == (
        "model.layers.{layer}.mlp.shared_expert.gate_proj.weight",
        "model.layers.{layer}.mlp.shared_expert.up_proj.weight",
    )
    assert (fc1.transform, fc1.tp_dim, fc2.tp_dim, gate.tp_dim) == ("gate_up", 0, 1, None)
    assert gate.hf == ("model.layers.{layer}.mlp.shared_expert_gate.weight",)
    assert all(r.layers == "moe" for r in shared.values())
    mixtral = [r.hf for r in rules_for(tiny_config("mixtral")) if r.layers == "moe"]
    assert mixtral == [
        ("model.layers.{layer}.block_sparse_moe.gate.weight",),
        (
            "model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight",
            "model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight",
        ),
        ("model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight",),
    ]
    assert moe_layers(tiny_config("mixtral", num_hidden_layers=3)) == (True, True, True)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_a_critics_table_ends_in_the_replicated_value_head_and_round_trips(tied, tp, pp):
    """A critic (``head="value"``) reads and writes ``score.weight`` / ``score.bias`` (whole on
    every tp rank of the last stage) instead of any output layer, tied embeddings or not, and
    its HF tensors round-trip bit-exactly on every layout."""
    config = tiny_config("qwen2", tie_word_embeddings=tied)
    rules = rules_for(config, "value")
    assert rules[-2:] == [VALUE_HEAD, VALUE_BIAS] and VALUE_HEAD.tp_dim is None
    assert not any(r.mcore == "output_layer.weight" and r.hf != ("score.weight",) for r in rules)
    no_bias = tiny_config("qwen2", token_classification_bias=False)
    assert rules_for(no_bias, "value")[-1] == VALUE_HEAD
    torch.manual_seed(0)
    hf = {
        **AutoModelForCausalLM.from_config(config).model.state_dict(prefix="model."),
        "score.weight": torch.randn(1, config.hidden_size),
        "score.bias": torch.randn(1),
    }
    local = {
        (t, p, 0): hf_to_mcore(
            hf, config, tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp, head="value"
        )
        for t in range(tp)
        for p in range(pp)
    }
    last = local[tp - 1, pp - 1, 0]
    assert torch.equal(last["output_layer.weight"], hf["score.weight"])
    assert "output_layer.weight" not in local[0, 0, 0] or pp == 1
    back = dict(mcore_to_hf(local, config, tp_size=tp, pp_size=pp, head="value"))
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    with pytest.raises(ValueError, match="unknown head 'critic'; use one of lm, value"):
        rules_for(config, "critic")
