"""`resolve_moe_targets`: what ``"all-linear"`` and ``target_parameters`` mean on an MoE model
(HF skeletons on the meta device), and the refusals, each naming the fix. Training and export
on both backends are in ``tests/test_expert_lora.py``."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from twinkle_fn.lora import lora_config, moe_targets, resolve_moe_targets
from twinkle_fn.testing import tiny_config

EXPERTS = ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}


@pytest.fixture(scope="module")
def hf():
    with torch.device("meta"):
        return {
            name: AutoModelForCausalLM.from_config(tiny_config(name))
            for name in ("qwen2", "qwen3_moe", "qwen2_moe", "mixtral")
        }


def _resolve(module, **fields):
    return resolve_moe_targets(lora_config({"r": 4, **fields}), module)


def test_the_fused_experts_and_the_gates_are_found(hf):
    found = moe_targets(hf["qwen2_moe"])
    assert found.experts[:2] == (
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
    )
    assert found.gates[:2] == ("model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate")
    assert found.layer_paths() == EXPERTS
    assert moe_targets(hf["qwen2"]) == moe_targets(hf["qwen2"]).__class__((), ())


@pytest.mark.parametrize(
    ("name", "modules"),
    [
        ("qwen3_moe", ATTENTION),
        ("mixtral", ATTENTION),
        ("qwen2_moe", ATTENTION | {"gate_proj", "up_proj", "down_proj"}),  # the shared expert
    ],
)
def test_all_linear_adds_the_experts_and_leaves_the_gates_out(hf, name, modules):
    config = _resolve(hf[name], target_modules="all-linear")
    assert config.target_modules == modules
    assert config.target_parameters == EXPERTS


def test_explicit_choices_are_kept(hf):
    moe = hf["qwen3_moe"]
    no_experts = _resolve(moe, target_modules="all-linear", target_parameters=[])
    assert no_experts.target_parameters is None
    down = _resolve(moe, target_modules=["q_proj"], target_parameters=["experts.down_proj"])
    assert down.target_parameters == ["experts.down_proj"]
    dense = _resolve(hf["qwen2"], target_modules="all-linear")
    assert dense.target_modules == "all-linear" and dense.target_parameters is None


@pytest.mark.parametrize(
    ("name", "fields", "match"),
    [
        ("qwen2", {"target_parameters": ["mlp.down_proj.weight"]}, "this model is dense"),
        ("qwen3_moe", {"target_modules": ["gate"]}, "router or shared-expert gate"),
        ("qwen2_moe", {"target_modules": ["shared_expert_gate"]}, "keeps it frozen"),
        ("qwen3_moe", {"target_parameters": ["mlp.gate.weight"]}, "routers are never adapted"),
        ("qwen3_moe", {"target_parameters": ["no_such"]}, "selects none of the fused expert"),
        (
            "qwen3_moe",
            {"target_modules": ["q_proj"], "target_parameters": ["experts.down_proj"]}
            | {"lora_dropout": 0.1},
            "lora_dropout=0",
        ),
    ],
)
def test_bad_moe_targets_are_refused_with_the_fix(hf, name, fields, match):
    with pytest.raises(ValueError, match=match):
        _resolve(hf[name], **fields)


def test_all_linear_with_dropout_leaves_the_experts_out_and_says_so(hf):
    """peft's expert adapters take no dropout: "all-linear" with a dropout (upstream's default
    0.05) adapts the linears only, with a warning naming the fix."""
    with pytest.warns(UserWarning, match="set lora_dropout=0 to adapt the experts"):
        config = _resolve(hf["qwen3_moe"], target_modules="all-linear", lora_dropout=0.05)
    assert config.target_parameters is None and "q_proj" in config.target_modules
