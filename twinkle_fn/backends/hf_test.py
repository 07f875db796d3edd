"""twinkle_fn/backends/hf.py: the decoder's inputs built from a batch."""

import torch

import twinkle_fn as tf
from twinkle_fn.backends.hf import model_inputs
from twinkle_fn.data import pad_collate
from twinkle_fn.testing import random_features, tiny_config

CPU = torch.device("cpu")


def _batch(min_len: int, max_len: int) -> dict[str, torch.Tensor]:
    feats = random_features(4, vocab_size=64, min_len=min_len, max_len=max_len, seed=0)
    return pad_collate(feats, pad_token_id=0)


def test_a_host_mask_of_all_ones_is_left_out():
    full = _batch(16, 16)  # every row as long as the longest: nothing is padded
    assert bool(full["attention_mask"].all())
    assert "attention_mask" not in model_inputs(full, CPU)
    padded = _batch(4, 16)
    assert not bool(padded["attention_mask"].all())
    assert torch.equal(model_inputs(padded, CPU)["attention_mask"], padded["attention_mask"])


def test_leaving_out_an_all_ones_mask_changes_no_logit():
    config = tiny_config(vocab_size=64)
    module = tf.models.from_hf_config(config, seed=0).module.eval()
    batch = _batch(16, 16)
    with torch.no_grad():
        without = module(**model_inputs(batch, CPU), use_cache=False).logits
        masked = module(
            **model_inputs(batch, CPU), attention_mask=batch["attention_mask"], use_cache=False
        ).logits
    assert torch.equal(without, masked)
