"""Ulysses sequence parallelism: the batch split on one process, and the refusal of heads the
group does not divide."""

import pytest
import torch

import twinkle_fn as tf
from twinkle_fn.backends.transformers.ulysses import KEY_MASK, local_batch
from twinkle_fn.testing import tiny_config


def test_local_batch_pads_to_the_group_and_keeps_global_positions_and_boundaries():
    packed = {
        "input_ids": torch.arange(1, 6)[None],  # [1, 5]: samples of 3 and 2 tokens
        "labels": torch.tensor([[2, 3, -100, 5, -100]]),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1]]),
        "cu_seqlens": torch.tensor([0, 3, 5]),
        "max_seqlen": 3,
    }
    second = local_batch(packed, 2, 1)
    assert second["input_ids"].tolist() == [[4, 5, 0]]
    assert second["labels"].tolist() == [[5, -100, -100]]
    assert second["position_ids"].tolist() == [[0, 1, 2]]  # the padding continues the last
    assert second["cu_seqlens"].tolist() == [0, 3, 5, 6]  # the padding is a sample of its own
    padded = {
        "input_ids": torch.tensor([[1, 2, 3], [4, 5, 0]]),
        "labels": torch.tensor([[2, 3, -100], [5, -100, -100]]),
        "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
    }
    first = local_batch(padded, 2, 0)
    assert first["position_ids"].tolist() == [[0, 1], [0, 1]]
    assert first[KEY_MASK].tolist() == [[True] * 3 + [False], [True, True, False, False]]
    assert "attention_mask" not in first


def test_heads_the_group_does_not_divide_are_refused_before_any_compute():
    model = tf.models.from_hf_config(
        tiny_config("qwen2", num_key_value_heads=1), seed=0, device="cpu"
    )
    with pytest.raises(ValueError, match="ulysses=2 does not divide the 1 key/value heads"):
        tf.init(model, tf.optim.adamw(1e-2), tf.Mesh(ulysses=2))
