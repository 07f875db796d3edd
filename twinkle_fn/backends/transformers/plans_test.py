import dataclasses

import pytest
import torch

from twinkle_fn.backends.transformers.plans import local_specs, param_specs, tp_plan
from twinkle_fn.mesh import Mesh
from twinkle_fn.models.families import FAMILIES, family, registered
from twinkle_fn.sharding import ShardSpec
from twinkle_fn.testing import tiny_config


def test_every_family_has_a_plan_with_attention_split():
    for name in FAMILIES:
        plan = family(name).tp_plan
        assert plan["self_attn.q_proj"] == "colwise" and plan["self_attn.o_proj"] == "rowwise"
        assert tp_plan(tiny_config(name), 1) == plan
        if family(name).tensor_parallel is not None:
            with pytest.raises(
                ValueError, match=f"tp=2 is not supported for model family '{name}'"
            ):
                tp_plan(tiny_config(name), 2)
            continue
        assert tp_plan(tiny_config(name), 2) == plan


def test_a_family_the_backend_does_not_split_is_refused_with_its_reason():
    row = dataclasses.replace(family("qwen2"), tensor_parallel="its heads share a tensor")
    with registered(row), pytest.raises(ValueError, match="its heads share a tensor") as err:
        tp_plan(tiny_config("qwen2"), 2)
    assert "tp=2 is not supported for model family 'qwen2'" in str(err.value)
    with registered(row):
        assert tp_plan(tiny_config("qwen2"), 1) == row.tp_plan


def test_specs_follow_the_plan_then_fsdp():
    names = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.1.self_attn.o_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
    ]
    specs = param_specs(names, tiny_config("qwen2"), Mesh(fsdp=2, tp=2))
    fsdp = ShardSpec(0, "fsdp")
    assert specs[names[0]] == (ShardSpec(0, "tp"), fsdp)
    assert specs[names[1]] == (ShardSpec(0, "tp"), fsdp)
    assert specs[names[2]] == (ShardSpec(1, "tp"), fsdp)
    assert specs[names[3]] == (ShardSpec(1, "tp"), fsdp)
    assert specs[names[4]] == (fsdp,) and specs[names[5]] == (fsdp,)


@pytest.mark.parametrize(
    ("sizes", "axis"),
    [({"dp": 2}, "dp"), ({"dp": 2, "tp": 2}, "dp"), ({"dp": 2, "fsdp": 2}, "fsdp"), ({}, "fsdp")],
)
def test_the_data_split_is_over_dp_only_when_it_is_the_only_data_axis(sizes, axis):
    specs = param_specs(["model.norm.weight"], tiny_config("qwen2"), Mesh(**sizes))
    assert specs["model.norm.weight"] == (ShardSpec(0, axis),)


def test_moe_experts_are_not_tp_split():
    specs = param_specs(
        ["model.layers.0.mlp.experts.gate_up_proj"], tiny_config("qwen3_moe"), Mesh(tp=2)
    )
    assert specs["model.layers.0.mlp.experts.gate_up_proj"] == (ShardSpec(0, "fsdp"),)


def test_local_specs_cut_tp_then_fsdp():
    mesh = Mesh(fsdp=2, tp=2)
    w = torch.arange(8 * 3).reshape(8, 3)
    specs = (ShardSpec(0, "tp"), ShardSpec(0, "fsdp"))
    pieces = [local_specs(w, specs, mesh.coords(r), mesh) for r in range(4)]
    # rank order is tp fastest: rank 1 is tp=1, fsdp=0 -> second half, its first quarter
    assert torch.equal(pieces[1], w[4:6])
    assert torch.equal(torch.cat([pieces[0], pieces[2], pieces[1], pieces[3]]), w)


@pytest.mark.parametrize(
    ("overrides", "tp", "what"),
    [
        ({}, 3, "4 attention heads"),
        ({"num_attention_heads": 4, "num_key_value_heads": 1}, 2, "1 key/value heads"),
        ({"num_key_value_heads": 4, "intermediate_size": 66}, 4, "66 MLP intermediate features"),
    ],
)
def test_tp_that_does_not_divide_is_named(overrides, tp, what):
    with pytest.raises(ValueError, match=f"tp={tp} does not divide the {what}"):
        tp_plan(tiny_config("qwen2", **overrides), tp)


def test_a_shared_expert_is_split_like_a_dense_mlp():
    plan = tp_plan(tiny_config("qwen2_moe"), 2)
    assert plan["mlp.shared_expert.down_proj"] == "rowwise"
    specs = param_specs(
        ["model.layers.0.mlp.shared_expert.up_proj.weight", "model.layers.0.mlp.gate.weight"],
        tiny_config("qwen2_moe"),
        Mesh(tp=2),
    )
    assert specs["model.layers.0.mlp.shared_expert.up_proj.weight"][0] == ShardSpec(0, "tp")
    assert specs["model.layers.0.mlp.gate.weight"] == (ShardSpec(0, "fsdp"),)
    bad = tiny_config("qwen2_moe", num_key_value_heads=4, shared_expert_intermediate_size=30)
    with pytest.raises(ValueError, match="30 shared expert intermediate features"):
        tp_plan(bad, 4)
