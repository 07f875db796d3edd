"""twinkle_fn/backends/hf.py: the decoder's inputs built from a batch."""

import importlib

import pytest
import torch

import twinkle_fn as tf
from twinkle_fn.backends.transformers.compute import model_inputs
from twinkle_fn.data import pad_collate
from twinkle_fn.models import families
from twinkle_fn.models.families import FAMILIES
from twinkle_fn.testing import random_features, tiny_config

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


@pytest.mark.parametrize("name", [f for f in FAMILIES if families.family(f).mask_mapping])
def test_a_mask_mapping_family_builds_no_mask(name, monkeypatch):
    """The decoders of families with `Family.mask_mapping` take the mapping as their masks:
    transformers' mask creation (which reads the positions on the device) never runs."""
    config = tiny_config(name, vocab_size=64)
    module = tf.models.from_hf_config(config, seed=0).module.eval()
    decoder_module = importlib.import_module(type(module.get_decoder()).__module__)

    def refuse(**_):
        raise AssertionError("create_causal_mask ran")

    monkeypatch.setattr(decoder_module, "create_causal_mask", refuse)
    with torch.no_grad():
        module(**model_inputs(_batch(16, 16), CPU, config), use_cache=False)
        with pytest.raises(AssertionError, match="create_causal_mask ran"):
            module(**model_inputs(_batch(16, 16), CPU), use_cache=False)
