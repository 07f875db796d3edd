"""`FactorScaledLinear` computes peft's LoRA linear, and its backward scales no output-sized
gradient (only the ``[r, in]`` factor's)."""

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora.layer import Linear

import twinkle_fn as tf
from twinkle_fn.backends.transformers.lora_layer import FactorScaledLinear, scale_factors
from twinkle_fn.testing import op_shapes, tiny_config

TOKENS, IN, OUT, R = 6, 12, 20, 4


def _layer(alpha: float, seed: int = 0, **options) -> Linear:
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(IN, OUT))
    # init_lora_weights=False: B random too, so the update is not zero
    config = LoraConfig(
        r=R, lora_alpha=alpha, target_modules=["0"], init_lora_weights=False, **options
    )
    inject_adapter_in_model(config, module)
    return module[0]


def _run(forward, layer, x):
    """Output and the gradients of input and factors under `forward` (peft's or ours)."""
    x = x.clone().requires_grad_()
    out = forward(layer, x)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
    grads = [x.grad] + [p.grad.clone() for p in layer.parameters() if p.requires_grad]
    layer.zero_grad(set_to_none=True)
    return out.detach(), grads


@pytest.mark.parametrize("alpha", [8.0, 3.0], ids=["scale 2", "scale 0.75"])
def test_matches_peft_forward_and_gradients(alpha):
    layer = _layer(alpha)
    x = torch.randn(TOKENS, IN, generator=torch.Generator().manual_seed(1))
    want_out, want_grads = _run(Linear.forward, layer, x)
    got_out, got_grads = _run(FactorScaledLinear.forward, layer, x)
    # a power-of-two scale is exact on either side of the factors; 0.75 rounds the scaled A
    # factor instead of the output (float32: a few ulps)
    tol = dict(rtol=0, atol=0) if alpha == 8.0 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_out, want_out, **tol)
    for got, want in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize(
    ("forward", "scaled"), [(Linear.forward, (TOKENS, OUT)), (FactorScaledLinear.forward, (R, IN))]
)
def test_backward_scales_no_output_sized_gradient(forward, scaled):
    layer = _layer(3.0)
    for p in layer.base_layer.parameters():
        p.requires_grad_(False)
    out = forward(layer, torch.randn(TOKENS, IN, requires_grad=True))
    with op_shapes(torch.ops.aten.mul) as shapes:
        out.backward(torch.ones_like(out))
    assert shapes == [scaled]


def test_two_active_adapters_and_a_b_bias_match_peft():
    """peft scales ``B``'s bias too (``lora_bias``): such an adapter takes peft's forward."""
    layer = _layer(3.0, lora_bias=True)
    config = LoraConfig(r=2, lora_alpha=8, target_modules=["0"], init_lora_weights=False)
    inject_adapter_in_model(config, torch.nn.Sequential(layer), adapter_name="second")
    layer.set_adapter(["default", "second"])
    x = torch.randn(TOKENS, IN, generator=torch.Generator().manual_seed(1))
    want_out, want_grads = _run(Linear.forward, layer, x)
    scale_factors(torch.nn.Sequential(layer))
    got_out, got_grads = _run(FactorScaledLinear.forward, layer, x)
    torch.testing.assert_close(got_out, want_out, rtol=1e-6, atol=1e-6)
    for got, want in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_other_forwards_are_peft_s():
    layer = _layer(3.0)
    scale_factors(torch.nn.Sequential(layer))
    x = torch.randn(TOKENS, IN)
    with torch.no_grad():
        layer.enable_adapters(False)  # the base layer alone
        torch.testing.assert_close(layer(x), layer.base_layer(x), rtol=0, atol=0)
        layer.enable_adapters(True)
        layer.merge()
        merged = layer(x)
        layer.unmerge()
        torch.testing.assert_close(merged, Linear.forward(layer, x), rtol=1e-5, atol=1e-5)


def test_add_lora_turns_every_peft_linear():
    model = tf.models.from_hf_config(tiny_config(), seed=0, device="cpu")
    model = tf.lora.add_lora(model, {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})
    adapted = [m for m in model.module.modules() if isinstance(m, Linear)]
    assert adapted and all(type(m) is FactorScaledLinear for m in adapted)


def test_a_factor_behind_hooks_runs_its_own_forward():
    """tp's redistributions are module hooks on the factors: they must still run."""
    layer = _layer(3.0)
    scale_factors(torch.nn.Sequential(layer))
    calls = []
    layer.lora_A["default"].register_forward_hook(lambda *args: calls.append(1))
    x = torch.randn(TOKENS, IN)
    out = layer(x)
    assert calls == [1]
    torch.testing.assert_close(out, Linear.forward(layer, x), rtol=0, atol=0)


def test_an_adapted_decoder_layer_compiles_into_one_graph():
    """A graph break would split each compiled layer in pieces that inductor fuses and
    partitions apart."""
    model = tf.models.from_hf_config(tiny_config("qwen3"), seed=0, device="cpu")
    model = tf.lora.add_lora(model, {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})
    adapted = model.module.model.layers[0].mlp
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(adapted)(torch.randn(2, 5, adapted.gate_proj.in_features))
    assert explanation.break_reasons == [] and explanation.graph_count == 1
