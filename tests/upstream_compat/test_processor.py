"""`InputProcessor.collate_fn` as upstream documents it: a list of batches, the whole batch or
one per micro batch, micro batches sharing the batch's padded length unless
``variable_seq_lengths`` (or padding-free packing) gives each its own."""

import pytest
import torch

from twinkle.processor import InputProcessor


def _feature(n: int, start: int) -> dict:
    return {"input_ids": torch.arange(start, start + n), "labels": torch.arange(start, start + n)}


FEATURES = [_feature(n, 10 * i) for i, n in enumerate((2, 5, 3, 1))]


def test_the_whole_batch_is_one_padded_batch():
    (batch,) = InputProcessor().collate_fn(FEATURES)
    assert batch["input_ids"].shape == (4, 5)
    assert batch["input_ids"][1].tolist() == [10, 11, 12, 13, 14]
    assert batch["attention_mask"].sum(dim=1).tolist() == [2, 5, 3, 1]


def test_micro_batches_share_the_padded_length_unless_variable():
    fixed = InputProcessor().collate_fn(FEATURES, micro_batch_size=2)
    assert [b["input_ids"].shape for b in fixed] == [(2, 5), (2, 5)]
    assert fixed[1]["input_ids"][0, :3].tolist() == [20, 21, 22]
    variable = InputProcessor().collate_fn(FEATURES, micro_batch_size=2, variable_seq_lengths=True)
    assert [b["input_ids"].shape for b in variable] == [(2, 5), (2, 3)]
    packed = InputProcessor(padding_free=True).collate_fn(FEATURES, micro_batch_size=3)
    assert [b["input_ids"].shape for b in packed] == [(1, 10), (1, 1)]
    assert packed[0]["cu_seqlens"].tolist() == [0, 2, 7, 10]


def test_a_micro_batch_size_must_be_a_positive_int():
    with pytest.raises(ValueError, match="micro_batch_size must be a positive int, got 0"):
        InputProcessor().collate_fn(FEATURES, micro_batch_size=0)
