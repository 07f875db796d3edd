"""The option ``fp8`` on the transformers backend (CPU: torch's reference ``_scaled_mm``).

Tolerance of the training comparison: each float8 operand is off by up to 2^-4 relative (e4m3's
3 mantissa bits), so each GEMM output by up to ~2^-3 relative of its absolute-value sum, far less
in the mean (rounding errors of random sign average over the 32-64 products); a loss averaged
over every supervised token moves much less. Measured over 6 AdamW steps of the tiny Qwen2 on
one batch (float32, lr 1e-2; the loss falls 4.56 -> 3.00): the loss differs from the float32
run's by at most 0.36% relative (rowwise 0.24%); the bound asserted is 1%, and the runs must
differ by more than float32 rounding (the float8 path ran).
"""

from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file

import twinkle_fn as tf
from twinkle_fn.backends.fp8 import E4M3, dequantise
from twinkle_fn.backends.transformers.fp8_linears import FP8Linear, _store_frozen, stored_scales
from twinkle_fn.data import pack
from twinkle_fn.testing import assert_within_float8_rounding, random_features, tiny_config

STEPS = 6


def _losses(fp8, config=None, lora=None, store=False, seed=0, steps=STEPS):
    options = {"fp8": fp8, "fp8_store_frozen": store}
    model = tf.models.from_hf_config(config or tiny_config("qwen2"), seed=seed, options=options)
    if lora is not None:
        model = tf.lora.add_lora(model, lora)
    state = tf.init(model, tf.optim.adamw(1e-2), tf.Mesh())
    batch = pack(random_features(8, seed=0))
    losses = []
    for _ in range(steps):
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


_LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")


@pytest.fixture(scope="module")
def stored_runs():
    """LoRA under tensorwise fp8, the bases stored in float8 and not."""
    return {store: _losses("tensorwise", lora=_LORA, store=store) for store in (False, True)}


def test_lora_bases_stored_in_float8_train_bit_for_bit_as_tensorwise(stored_runs):
    """``fp8_store_frozen`` stores each base as tensorwise quantises it in every forward: the
    losses are the same floats, and the bases take one byte an element."""
    (_, plain), (state, stored) = stored_runs[False], stored_runs[True]
    assert stored == plain
    scales = stored_scales(state.model.module)
    params = dict(state.model.module.named_parameters())
    assert len(scales) == 14 and all(n.endswith(".base_layer.weight") for n in scales)
    assert all(params[n].dtype == E4M3 and params[n].element_size() == 1 for n in scales)
    assert not set(scales) & set(state.params)  # frozen: not in the trained state
    assert not any(n.endswith("fp8_weight_scale") for n in state.model.module.state_dict())


def test_stored_bases_export_merged_as_dequantised_base_plus_peft_delta(stored_runs):
    """A merged export adds peft's own delta (``get_delta_weight``) to the dequantised base;
    every tensor that is not a stored base equals the plain run's export."""
    (plain, _), (state, _) = stored_runs[False], stored_runs[True]
    module = state.model.module
    scales, params = stored_scales(module), dict(module.named_parameters())
    layers = {n: m for n, m in module.named_modules() if isinstance(m, LoraLayer)}

    def merged(s):
        out = tf.export_weights(s, dtype=torch.float32, lora="merged")
        return {n: t.clone() for bucket in out for n, t in bucket}

    got, want = merged(state), merged(plain)
    assert got.keys() == want.keys()
    for name in scales:
        plain_name = name.replace(".base_layer.", ".")
        delta = layers[name.removesuffix(".base_layer.weight")].get_delta_weight("default")
        expected = dequantise(params[name], scales[name]) + delta.float()
        torch.testing.assert_close(got[plain_name], expected, rtol=1e-6, atol=1e-7)
    bases = {n.replace(".base_layer.", ".") for n in scales}
    assert all(torch.equal(got[n], want[n]) for n in got if n not in bases)


def test_a_checkpoint_of_stored_bases_holds_them_dequantised_and_loads_them_bit_for_bit(
    stored_runs, tmp_path
):
    state = stored_runs[True][0]
    module = state.model.module
    scales, params = stored_scales(module), dict(module.named_parameters())
    tf.checkpoint.save(state, tmp_path / "ckpt")
    files = {}
    for f in (tmp_path / "ckpt").glob("*.safetensors"):
        files.update(load_file(f))
    for name in scales:
        assert torch.equal(files[name], dequantise(params[name], scales[name]))
    other, _ = _losses("tensorwise", lora=_LORA, store=True, seed=1, steps=0)
    other_params = dict(other.model.module.named_parameters())
    name = next(iter(scales))
    assert not torch.equal(other_params[name].view(torch.uint8), params[name].view(torch.uint8))
    loaded = tf.checkpoint.load(other, tmp_path / "ckpt")
    loaded_params = dict(loaded.model.module.named_parameters())
    loaded_scales = stored_scales(loaded.model.module)
    for name in scales:
        assert loaded_params[name].dtype == E4M3
        assert torch.equal(loaded_params[name].view(torch.uint8), params[name].view(torch.uint8))
        assert torch.equal(loaded_scales[name], scales[name])


def test_fp8_store_frozen_refusals():
    model = SimpleNamespace(options={"fp8_store_frozen": "yes"})
    with pytest.raises(ValueError, match=r"option fp8_store_frozen='yes' must be True or False"):
        _store_frozen(model, SimpleNamespace(tp=1))
    model = SimpleNamespace(options={"fp8_store_frozen": True, "fp8": "tensorwise"})
    with pytest.raises(ValueError, match="tp=2 splits the linears; leave it off with tp"):
        _store_frozen(model, SimpleNamespace(tp=2))
    assert _store_frozen(model, SimpleNamespace(tp=1)) is True
    with pytest.raises(ValueError, match=r"set option fp8 .* too"):
        _losses(None, store=True, steps=0)
