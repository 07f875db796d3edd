"""The option ``fp8`` on the megatron backend (one process, CPU: torch's reference
``_scaled_mm``). The tolerance of the training comparison is the transformers backend's
(`twinkle_fn/backends/transformers/fp8_linears_test.py`): 1% relative per step, measured 0.42% at
most (rowwise 0.40%) over 6 AdamW steps on one batch while the loss falls 4.56 -> 3.01."""

import functools

import pytest
import torch
from peft import LoraConfig

import twinkle_fn as tf
from twinkle_fn.backends.fp8 import E4M3
from twinkle_fn.backends.megatron import parallel
from twinkle_fn.backends.megatron.backend import megatron_optimizer
from twinkle_fn.data import pack
from twinkle_fn.testing import assert_within_float8_rounding, random_features, tiny_config

STEPS = 6


def _run(fp8, config=None, lora=None, store=None, out=None):
    """(losses, the fp8 linears' names) of `STEPS` steps of the tiny Qwen2 on one batch; `out`
    (a dict) gets the stored weights' dtypes and the merged float32 export."""
    options = {"fp8": fp8} if lora is None else {"fp8": fp8, "lora": lora}
    if store is not None:
        options["fp8_store_frozen"] = store
    model = tf.models.from_hf_config(
        config or tiny_config("qwen2"), seed=0, backend="megatron", options=options
    )
    try:
        state = tf.init(model, megatron_optimizer(1e-2))
        gpt = state.model.placement.module
        names = {
            n
            for n, m in gpt.named_modules()
            if isinstance(m.__dict__.get("_forward_impl"), functools.partial)
        }
        batch = pack(random_features(8, seed=0))
        losses = []
        for _ in range(STEPS):
            grads, _ = tf.fwd_bwd(state, batch)
            state, info = tf.step(state, grads)
            losses.append(float(info["loss"]))
        if out is not None:
            out["dtypes"] = {
                n: p.dtype for n, p in gpt.named_parameters() if n.endswith("base_layer.weight")
            }
            merged = tf.export_weights(state, dtype=torch.float32, lora="merged")
            out["merged"] = {n: t.clone() for bucket in merged for n, t in bucket}
        return losses, names
    finally:
        parallel.destroy()


@pytest.fixture(scope="module")
def runs(megatron_world):
    return {fp8: _run(fp8) for fp8 in (None, "rowwise", "tensorwise")}


LINEARS = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)


def _decoder_linears(suffix: str = "") -> set[str]:
    """The tiny Qwen2's decoder linears (`suffix`: under a LoRA wrapper, the base's name)."""
    return {f"decoder.layers.{i}.{sub}{suffix}" for i in range(2) for sub in LINEARS}


def test_the_decoder_linears_take_fp8_and_nothing_else(runs):
    assert runs[None][1] == set()
    assert runs["rowwise"][1] == _decoder_linears()


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_a_few_steps_train_within_float8_rounding_of_the_float32_run(runs, recipe):
    base, fp8 = runs[None][0], runs[recipe][0]
    assert base[-1] < base[0]
    assert_within_float8_rounding(base, fp8)


LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")


@pytest.fixture(scope="module")
def lora_runs(megatron_world):
    return {fp8: _run(fp8, lora=LORA) for fp8 in (None, "rowwise", "tensorwise")}


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_lora_bases_take_fp8_and_train_within_float8_rounding(lora_runs, recipe):
    """Under LoRA the frozen base linears multiply in float8 (forward and input gradient), the
    adapters' factors do not; the adapters then train as with compute-dtype bases."""
    base, (fp8, names) = lora_runs[None][0], lora_runs[recipe]
    assert names == _decoder_linears(".base_layer")
    assert base[-1] < base[0]
    assert_within_float8_rounding(base, fp8)


def test_refusals(megatron_world):
    odd = tiny_config("qwen2", intermediate_size=40)
    with pytest.raises(
        ValueError, match=r"linear decoder.layers.0.mlp.linear_fc2 has a weight of shape \[32, 40\]"
    ):
        _run("rowwise", config=odd)
    with pytest.raises(ValueError, match=r"option fp8='hybrid' is not a recipe"):
        _run("hybrid")


def test_lora_bases_stored_in_float8_train_bit_for_bit_and_export_dequantised(megatron_world):
    """``fp8_store_frozen``: the bases stored in float8 train the adapters to the same floats as
    tensorwise quantising them every step; a merged export adds the update to the dequantised
    base: equal to the plain run's export except on the adapted weights, which differ from it
    by no more than e4m3's rounding of the base (2^-4 relative)."""
    plain, stored = {}, {}
    losses, _ = _run("tensorwise", lora=LORA, out=plain)
    stored_losses, names = _run("tensorwise", lora=LORA, store=True, out=stored)
    assert stored_losses == losses
    assert names == _decoder_linears(".base_layer")
    assert set(stored["dtypes"].values()) == {E4M3} and len(stored["dtypes"]) == 8
    assert stored["merged"].keys() == plain["merged"].keys()
    adapted = 0
    for name, got in stored["merged"].items():
        want = plain["merged"][name]
        if torch.equal(got, want):
            continue
        adapted += 1
        assert (got - want).abs().max() <= 2.0**-4 * want.abs().max(), name
    assert adapted == 14  # q, k, v, o, gate, up, down of each layer


def test_fp8_store_frozen_refusals(megatron_world):
    with pytest.raises(ValueError, match=r"option fp8_store_frozen='yes' must be True or False"):
        _run("tensorwise", lora=LORA, store="yes")
    with pytest.raises(ValueError, match=r"set option fp8 .* too"):
        _run(None, lora=LORA, store=True)


def _stored_lora_loss(directory, save):
    """The loss of one forward of a stored-base LoRA state after `STEPS` steps saved to
    `directory` (`save`), or right after loading it from there."""
    options = {"fp8": "tensorwise", "lora": LORA, "fp8_store_frozen": True}
    model = tf.models.from_hf_config(
        tiny_config("qwen2"), seed=0, backend="megatron", options=options
    )
    batch = pack(random_features(8, seed=0))
    try:
        state = tf.init(model, megatron_optimizer(1e-2))
        if save:
            for _ in range(STEPS):
                state, _ = tf.step(state, tf.fwd_bwd(state, batch)[0])
            tf.checkpoint.save(state, directory)
        else:
            state = tf.checkpoint.load(state, directory)
        gpt = state.model.placement.module
        assert all(
            p.dtype == E4M3 for n, p in gpt.named_parameters() if n.endswith("base_layer.weight")
        )
        aux = tf.fwd_bwd(state, batch)[1]
        return float(aux["loss_sum"] / aux["num_tokens"])
    finally:
        parallel.destroy()


def test_a_stored_base_lora_checkpoint_resumes_to_the_same_loss(megatron_world, tmp_path):
    """A LoRA checkpoint holds the adapters; loaded into a fresh state with stored bases, the
    next forward's loss is the saving run's, exactly."""
    saved = _stored_lora_loss(tmp_path / "ckpt", save=True)
    assert _stored_lora_loss(tmp_path / "ckpt", save=False) == saved
