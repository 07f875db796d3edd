"""The option ``fp8`` on the transformers backend (CPU: torch's reference ``_scaled_mm``).

Tolerance of the training comparison: each float8 operand is off by up to 2^-4 relative (e4m3's
3 mantissa bits), so each GEMM output by up to ~2^-3 relative of its absolute-value sum, far less
in the mean (rounding errors of random sign average over the 32-64 products); a loss averaged
over every supervised token moves much less. Measured over 6 AdamW steps of the tiny Qwen2 on
one batch (float32, lr 1e-2; the loss falls 4.56 -> 3.00): the loss differs from the float32
run's by at most 0.36% relative (rowwise 0.24%); the bound asserted is 1%, and the runs must
differ by more than float32 rounding (the float8 path ran).
"""

import pytest
from peft import LoraConfig

import twinkle_fn as tf
from twinkle_fn.backends.transformers.fp8_linears import FP8Linear
from twinkle_fn.data import pack
from twinkle_fn.testing import assert_within_float8_rounding, random_features, tiny_config

STEPS = 6


def _losses(fp8, config=None, lora=None):
    model = tf.models.from_hf_config(config or tiny_config("qwen2"), seed=0, options={"fp8": fp8})
    if lora is not None:
        model = tf.lora.add_lora(model, lora)
    state = tf.init(model, tf.optim.adamw(1e-2), tf.Mesh())
    batch = pack(random_features(8, seed=0))
    losses = []
    for _ in range(STEPS):
        grads, _ = tf.fwd_bwd(state, batch)
        state, info = tf.step(state, grads)
        losses.append(float(info["loss"]))
    return state, losses


@pytest.fixture(scope="module")
def runs():
    return {fp8: _losses(fp8) for fp8 in (None, "rowwise", "tensorwise")}


def test_the_decoder_linears_become_fp8_and_nothing_else(runs):
    module = runs["rowwise"][0].model.module
    converted = {n for n, m in module.named_modules() if isinstance(m, FP8Linear)}
    per_layer = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert converted == {
        f"model.layers.{i}.{'self_attn' if p.endswith(('q_proj', 'k_proj', 'v_proj', 'o_proj')) else 'mlp'}.{p}"
        for i in range(2)
        for p in per_layer
    }
    assert not any(isinstance(m, FP8Linear) for m in runs[None][0].model.module.modules())


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_a_few_steps_train_within_float8_rounding_of_the_float32_run(runs, recipe):
    base, fp8 = runs[None][1], runs[recipe][1]
    assert base[-1] < base[0]  # it trains
    assert_within_float8_rounding(base, fp8)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_lora_bases_take_fp8_and_train_within_float8_rounding(recipe):
    """Under LoRA the frozen base linears (peft's ``base_layer``) multiply in float8 (forward and
    input gradient), the adapters' factors do not; the adapters then train as with compute-dtype
    bases."""
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    reference = _losses(None, lora=lora)[1]
    state, losses = _losses(recipe, lora=lora)
    module = state.model.module
    converted = {n for n, m in module.named_modules() if isinstance(m, FP8Linear)}
    assert len(converted) == 14 and all(n.endswith(".base_layer") for n in converted)
    assert not any(p.requires_grad for n, p in module.named_parameters() if "base_layer" in n)
    assert reference[-1] < reference[0]
    assert_within_float8_rounding(reference, losses)


def test_refusals():
    with pytest.raises(ValueError, match=r"option fp8='hybrid' is not a recipe"):
        _losses("hybrid")
    odd = tiny_config("qwen2", intermediate_size=40)
    with pytest.raises(
        ValueError, match=r"linear model.layers.0.mlp.gate_proj has a weight of shape \[40, 32\]"
    ):
        _losses("rowwise", config=odd)
