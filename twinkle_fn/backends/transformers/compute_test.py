"""The transformers backend's compute: the decoder's inputs built from a batch, and a loss other than
the default against its float64 reference."""

import importlib

import pytest
import torch

import twinkle_fn as tf
from twinkle_fn.backends.transformers import compute
from twinkle_fn.backends.transformers.compute import model_inputs
from twinkle_fn.data import pack, pad_collate
from twinkle_fn.models import families
from twinkle_fn.models.families import FAMILIES
from twinkle_fn.testing import (
    policy_gradient_reference,
    random_features,
    tiny_config,
    with_advantages,
)

CPU = torch.device("cpu")


def _batch(min_len: int, max_len: int) -> dict[str, torch.Tensor]:
    feats = random_features(4, vocab_size=64, min_len=min_len, max_len=max_len, seed=0)
    return pad_collate(feats, pad_token_id=0)


def test_a_plainly_causal_host_batch_passes_no_mask_and_no_positions():
    full = _batch(16, 16)  # every row as long as the longest: nothing is padded
    assert bool(full["attention_mask"].all())
    assert model_inputs(full, CPU).keys() == {"input_ids"}
    assert model_inputs(full, CPU, tiny_config("llama")).keys() == {"input_ids"}
    mapped = model_inputs(full, CPU, tiny_config("qwen2"))
    assert mapped.keys() == {"input_ids", "attention_mask"}
    assert mapped["attention_mask"] == {"full_attention": None}
    sliding = tiny_config("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert model_inputs(full, CPU, sliding).keys() == {"input_ids"}


def test_padding_or_shifted_positions_are_passed():
    padded = _batch(4, 16)
    assert not bool(padded["attention_mask"].all())
    inputs = model_inputs(padded, CPU)
    assert torch.equal(inputs["attention_mask"], padded["attention_mask"])
    assert torch.equal(inputs["position_ids"], padded["position_ids"])
    shifted = {**_batch(16, 16)}
    shifted["position_ids"] = shifted["position_ids"] + 3
    assert torch.equal(model_inputs(shifted, CPU)["position_ids"], shifted["position_ids"])


@pytest.mark.parametrize("family", FAMILIES)
def test_leaving_them_out_changes_no_logit(family):
    config = tiny_config(family, vocab_size=64)
    module = tf.models.from_hf_config(config, seed=0).module.eval()
    batch = _batch(16, 16)
    with torch.no_grad():
        without = module(**model_inputs(batch, CPU, config), use_cache=False).logits
        explicit = dict(attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
        masked = module(**model_inputs(batch, CPU), **explicit, use_cache=False).logits
    assert torch.equal(without, masked)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_packed_row_gives_each_sample_its_own_logits(attention):
    """float64: the packed row's logits equal each sample's alone, to 1e-6 (transformers' RMSNorm
    normalises in float32 even in a float64 model, so a row's other matmul blocking can flip a
    float32 rounding: 1.7e-8 observed); on eager attention the block mask must be additive (a
    boolean one masked nothing: 0.2 off)."""
    config = tiny_config("qwen2", vocab_size=64)
    config._attn_implementation = attention
    module = tf.models.from_hf_config(config, seed=0).module.double().eval()
    feats = random_features(3, vocab_size=64, min_len=3, max_len=9, seed=4)
    row = pack(feats)
    with torch.no_grad():
        packed = module(**model_inputs(row, CPU, config), use_cache=False).logits[0]
        alone = [
            module(input_ids=torch.tensor([f["input_ids"]]), use_cache=False).logits[0]
            for f in feats
        ]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", [f for f in FAMILIES if families.family(f).mask_mapping])
def test_a_mask_mapping_family_builds_no_mask(name, monkeypatch):
    """The decoders of families with `Family.mask_mapping` take the mapping as their masks:
    transformers' mask creation (which reads the positions on the device) never runs."""
    config = tiny_config(name, vocab_size=64)
    if set(getattr(config, "layer_types", None) or ()) - {"full_attention"}:
        # sliding layers need their masks built: the mapping serves full attention only
        layers = ["full_attention"] * config.num_hidden_layers
        config = tiny_config(name, vocab_size=64, layer_types=layers)
    module = tf.models.from_hf_config(config, seed=0).module.eval()
    decoder_module = importlib.import_module(type(module.get_decoder()).__module__)

    def refuse(**_):
        raise AssertionError("create_causal_mask ran")

    monkeypatch.setattr(decoder_module, "create_causal_mask", refuse)
    with torch.no_grad():
        module(**model_inputs(_batch(16, 16), CPU, config), use_cache=False)
        with pytest.raises(AssertionError, match="create_causal_mask ran"):
            module(**model_inputs(_batch(16, 16), CPU), use_cache=False)


PG = tf.losses.policy_gradient(entropy_coef=0.1)


def _float64_state(seed=0):
    model = tf.models.from_hf_config(tiny_config("qwen2"), seed=seed, device="cpu")
    model.module.to(torch.float64)
    return tf.init(model, tf.optim.adamw(1e-3))


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_a_token_loss_equals_its_float64_reference_in_value_and_gradient(layout):
    """float64 throughout: the same sums in another order, so 1e-10 on the loss sum and on the
    gradients (sums of a few hundred token terms of size ~1)."""
    feats = with_advantages(random_features(5, seed=4), seed=4)
    batch = pack(feats) if layout == "packed" else pad_collate(feats, pad_token_id=0)
    grads, aux = tf.fwd_bwd(_float64_state(), batch, loss=PG)
    reference = tf.models.from_hf_config(tiny_config("qwen2"), seed=0, device="cpu").module
    want_sum, want_grads = policy_gradient_reference(
        reference.to(torch.float64), feats, PG.entropy_coef
    )
    assert int(aux["num_tokens"]) == sum(x != -100 for f in feats for x in f["labels"])
    torch.testing.assert_close(aux["loss_sum"], want_sum, rtol=1e-10, atol=1e-10)
    assert grads.params.keys() == want_grads.keys()
    for name, grad in grads.params.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-10, atol=1e-10, msg=name)


def test_k_micro_batches_of_a_token_loss_equal_one_batch():
    """float64: the same token terms summed in another order (1e-12 on sums, 1e-10 on grads)."""
    feats = with_advantages(random_features(6, seed=5), seed=5)
    state = _float64_state()
    one, _ = tf.fwd_bwd(state, pack(feats), loss=PG, donate=False)
    acc = None
    for part in (feats[:2], feats[2:3], feats[3:]):
        acc, _ = tf.fwd_bwd(state, pack(part), acc, loss=PG)
    assert int(acc.num_tokens) == int(one.num_tokens) and acc.num_micro_batches == 3
    torch.testing.assert_close(acc.loss_sum, one.loss_sum, rtol=1e-12, atol=1e-12)
    for name, grad in one.params.items():
        torch.testing.assert_close(acc.params[name], grad, rtol=1e-10, atol=1e-12, msg=name)


def test_the_default_loss_keeps_the_fused_head_and_a_token_loss_reads_logits(monkeypatch):
    """Unit advantages make the policy gradient the cross entropy: the fused head's loss and
    the logits path agree (float64: 1e-10), and only the default loss puts the head in loss
    mode."""
    modes = []
    real_loss_mode = compute.loss_mode

    def counted(*args, **kwargs):
        modes.append(True)
        return real_loss_mode(*args, **kwargs)

    monkeypatch.setattr(compute, "loss_mode", counted)
    feats = [{**f, "advantages": 1.0} for f in random_features(4, seed=6)]
    state = _float64_state()
    fused, _ = tf.fwd_bwd(state, pack(feats), donate=False)
    assert modes == [True]
    logits_path, _ = tf.fwd_bwd(state, pack(feats), loss=tf.losses.policy_gradient())
    assert modes == [True]
    torch.testing.assert_close(logits_path.loss_sum, fused.loss_sum, rtol=1e-10, atol=0)
    for name, grad in fused.params.items():
        torch.testing.assert_close(logits_path.params[name], grad, rtol=1e-9, atol=1e-12, msg=name)


def test_bind_points_the_module_at_the_given_tensors_and_names_a_missing_one():
    module = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sequential(torch.nn.Linear(3, 1)))
    new = {"0.weight": torch.zeros(3, 2), "1.0.bias": torch.ones(1)}
    compute.bind(module, new, sharded=False)
    assert module[0].weight is new["0.weight"] and module[1][0].bias is new["1.0.bias"]
    assert dict(module.named_parameters())["0.bias"] is module[0].bias  # others untouched
    for missing in ("0.scale", "2.weight", "1.1.weight"):
        with pytest.raises(KeyError, match=missing):
            compute.bind(module, {missing: torch.zeros(1)}, sharded=False)
