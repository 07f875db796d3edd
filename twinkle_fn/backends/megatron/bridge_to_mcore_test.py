"""`hf_to_mcore` reads exactly one rank's rows, in megatron-core's layout, and names what is
wrong before it reads; the round trip through `mcore_to_hf` on every mesh, and the names and
shapes against megatron-core's own GPTModel, are `bridge_test`'s."""

from collections import Counter

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from twinkle_fn.backends.megatron.bridge_rules import rules_for
from twinkle_fn.backends.megatron.bridge_to_mcore import hf_to_mcore
from twinkle_fn.testing import tiny_config


def test_qkv_rows_follow_megatron_group_interleaving(hf_checkpoint):
    """Rank 1 of tp=2 holds query group 1: [its 2 q heads, k_1, v_1], each head_dim rows."""
    cfg, state = hf_checkpoint("qwen2")
    hd, p = 8, "model.layers.0.self_attn."
    local = hf_to_mcore(state, cfg, tp_rank=1, tp_size=2)
    for kind in ("weight", "bias"):
        q, k, v = (state[f"{p}{x}_proj.{kind}"] for x in "qkv")
        expected = torch.cat([q[2 * hd : 4 * hd], k[hd : 2 * hd], v[hd : 2 * hd]])
        assert torch.equal(local[f"decoder.layers.0.self_attention.linear_qkv.{kind}"], expected)


def test_fc1_holds_each_ranks_gate_shard_then_up_shard(hf_checkpoint):
    cfg, state = hf_checkpoint("llama")
    gate, up = (state[f"model.layers.1.mlp.{x}_proj.weight"] for x in ("gate", "up"))
    fc1 = hf_to_mcore(state, cfg, tp_rank=1, tp_size=2)["decoder.layers.1.mlp.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([gate[32:], up[32:]]))


def test_experts_are_local_to_the_ep_rank_and_layers_to_the_stage(hf_checkpoint):
    cfg, state = hf_checkpoint("qwen3_moe")
    local = hf_to_mcore(state, cfg, pp_rank=1, pp_size=2, ep_rank=1, ep_size=2)
    got = local["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"]
    assert torch.equal(got, state["model.layers.1.mlp.experts.3.down_proj.weight"])
    assert torch.equal(
        local["decoder.layers.0.mlp.router.weight"], state["model.layers.1.mlp.gate.weight"]
    )


def test_lazy_getter_is_called_once_per_tensor_a_rank_needs(hf_checkpoint):
    cfg, state = hf_checkpoint("qwen3_moe")
    calls = Counter()

    def getter(name):
        calls[name] += 1
        return state[name]

    hf_to_mcore(getter, cfg, tp_rank=0, tp_size=2, pp_rank=1, pp_size=2, ep_rank=0, ep_size=2)
    assert set(calls.values()) == {1}
    assert all(".layers.1." in n or n in ("model.norm.weight", "lm_head.weight") for n in calls)
    assert not any(f"experts.{e}." in n for n in calls for e in (2, 3))


def _hf_to_mcore_error(state, cfg, **kw):
    with pytest.raises(ValueError) as info:
        hf_to_mcore(state, cfg, **kw)
    return str(info.value)


def test_clear_errors(hf_checkpoint):
    cfg, state = hf_checkpoint("llama")
    gpt2 = AutoConfig.for_model("gpt2")
    assert "unknown model family 'gpt2'" in _hf_to_mcore_error(state, gpt2)
    with pytest.raises(ValueError, match="unknown model family"):
        rules_for(gpt2)
    msg = _hf_to_mcore_error(state, cfg, tp_rank=0, tp_size=3)
    assert "num_key_value_heads=2" in msg and "tp_size=3" in msg
    msg = _hf_to_mcore_error(state, tiny_config("llama", num_key_value_heads=4), tp_size=8)
    assert "num_key_value_heads" in msg
    msg = _hf_to_mcore_error(state, tiny_config("llama", intermediate_size=66), tp_size=4)
    assert "intermediate_size=66" in msg
    assert "num_hidden_layers=2" in _hf_to_mcore_error(state, cfg, pp_size=3)
    assert "tp_rank=2" in _hf_to_mcore_error(state, cfg, tp_rank=2, tp_size=2)
    assert "vocab_multiple" in _hf_to_mcore_error(state, cfg, vocab_multiple=0)
    moe_cfg, moe_state = hf_checkpoint("qwen3_moe")
    assert "num_experts=4" in _hf_to_mcore_error(moe_state, moe_cfg, ep_size=3)
    assert "moe_intermediate_size=16" in _hf_to_mcore_error(moe_state, moe_cfg, etp_size=3)

    missing = {k: v for k, v in state.items() if k != "model.layers.1.self_attn.v_proj.weight"}
    assert "'model.layers.1.self_attn.v_proj.weight' is missing" in _hf_to_mcore_error(missing, cfg)
    wrong = {**state, "model.layers.0.mlp.up_proj.weight": torch.zeros(60, 32)}
    assert "up_proj.weight" in _hf_to_mcore_error(wrong, cfg, tp_size=2)
    with pytest.raises(TypeError, match="hf_state"):
        hf_to_mcore(42, cfg)


def test_in_memory_moe_state_dict_is_refused_with_a_hint():
    cfg = tiny_config("qwen3_moe")
    fused = AutoModelForCausalLM.from_config(cfg).state_dict()
    msg = _hf_to_mcore_error(fused, cfg)
    assert "experts.0.gate_proj.weight' is missing" in msg and "save_pretrained" in msg
