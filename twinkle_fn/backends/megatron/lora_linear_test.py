"""`LoraParallelLinear` on one rank: the base output plus ``scaling * B A x``, and `adapters_off`
giving the base alone (the multi-rank layouts are checked through whole models in `lora_test`)."""

import pytest
import torch
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer import TransformerConfig
from peft import LoraConfig

from twinkle_fn.backends.megatron.lora import LINEARS
from twinkle_fn.backends.megatron.lora_linear import LoraParallelLinear, adapters_off
from twinkle_fn.backends.megatron.spec import RowParallelLinear  # the one the layer spec builds
from twinkle_fn.testing import op_shapes


def _base(kind):
    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True
    )
    common = dict(config=config, init_method=torch.nn.init.normal_, bias=False, skip_bias_add=True)
    if kind == "column":
        return ColumnParallelLinear(8, 12, gather_output=False, **common)
    return RowParallelLinear(12, 8, input_is_parallel=True, **common)


@pytest.mark.parametrize(
    ("kind", "linear"), [("column", "mlp.linear_fc1"), ("row", "mlp.linear_fc2")]
)
def test_the_update_is_added_to_the_base_output_until_adapters_are_off(
    megatron_world, kind, linear
):
    """float32 on one rank: the same products in another order, 1e-6."""
    base = _base(kind)
    config = LoraConfig(r=2, lora_alpha=6, init_lora_weights=False)  # B random: a visible update
    layer = LoraParallelLinear(base, config, rule=LINEARS[linear], seed=0)
    x = torch.randn(5, 3, base.weight.shape[1])  # [seq, batch, in]
    a, b = layer.lora_A.weight, layer.lora_B.weight
    want_base = x @ base.weight.t()
    want = want_base + 3.0 * (x @ a.t()) @ b.t()  # scaling = alpha / r = 3
    out, bias = layer(x)
    assert bias is None
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    assert (out - want_base).abs().max() > 1e-2
    with adapters_off([layer]):
        torch.testing.assert_close(layer(x)[0], want_base, rtol=0, atol=0)
    torch.testing.assert_close(layer(x)[0], out, rtol=0, atol=0)


def test_a_zero_b_starts_at_the_base_output(megatron_world):
    base = _base("column")
    layer = LoraParallelLinear(
        base, LoraConfig(r=4, lora_alpha=8), rule=LINEARS["mlp.linear_fc1"], seed=1
    )
    x = torch.randn(2, 2, 8)
    assert (layer.lora_B.weight == 0).all()
    torch.testing.assert_close(layer(x)[0], base(x)[0], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kind", "linear"), [("column", "mlp.linear_fc1"), ("row", "mlp.linear_fc2")]
)
def test_an_adapted_linear_compiles_into_one_graph(megatron_world, kind, linear):
    """A graph break in an adapter splits each compiled decoder layer in pieces, which inductor
    fuses and partitions apart (megatron-core's own ``RowParallelLinear`` warned in every
    forward: a break in each row-parallel ``lora_A``)."""
    base = _base(kind)
    layer = LoraParallelLinear(base, LoraConfig(r=2, lora_alpha=4), rule=LINEARS[linear], seed=0)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(layer)(torch.randn(5, 3, base.weight.shape[1]))
    assert explanation.break_reasons == [] and explanation.graph_count == 1


@pytest.mark.parametrize(
    ("kind", "linear"), [("column", "mlp.linear_fc1"), ("row", "mlp.linear_fc2")]
)
def test_backward_scales_the_rank_r_gradient_not_the_output_gradient(megatron_world, kind, linear):
    """The scale multiplies the ``[seq, batch, r]`` intermediate, so backward scales an r-wide
    gradient; scaling the output made it write a scaled copy of the ``[seq, batch, out]`` one
    (13 ms of a 4B LoRA step on an H200, `benchmarks/RESULTS.md`)."""
    base = _base(kind)
    base.weight.requires_grad_(False)  # frozen, as under add_lora
    config = LoraConfig(r=2, lora_alpha=6, init_lora_weights=False)
    layer = LoraParallelLinear(base, config, rule=LINEARS[linear], seed=0)
    out, _ = layer(torch.randn(5, 3, base.weight.shape[1], requires_grad=True))
    with op_shapes(torch.ops.aten.mul) as shapes:
        out.backward(torch.ones_like(out))
    assert shapes == [(5, 3, 2)]
