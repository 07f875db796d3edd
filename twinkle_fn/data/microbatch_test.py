import pytest
import torch

from twinkle_fn.data.collate import pad_collate
from twinkle_fn.data.microbatch import split_batch, split_features
from twinkle_fn.data.packing import pack


def test_split_features_contiguous_and_balanced():
    parts = split_features(list(range(7)), 3)
    assert parts == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_features(list(range(6)), 3) == [[0, 1], [2, 3], [4, 5]]
    assert split_features(["a"], 1) == [["a"]]


def test_split_features_errors():
    with pytest.raises(ValueError, match="cannot split 2 features into 3 micro-batches"):
        split_features([1, 2], 3)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_micro_batches must be a positive int"):
            split_features([1, 2], bad)


def _batch(lengths):
    features = [{"input_ids": [i + 1] * n, "labels": [i + 1] * n} for i, n in enumerate(lengths)]
    return features, pad_collate(features, pad_token_id=0)


def test_split_batch_equals_collating_split_features_rows():
    _, batch = _batch([3, 1, 4, 1, 5])
    micro = split_batch(batch, 2)
    assert [m["input_ids"].shape[0] for m in micro] == [3, 2]
    for part, rows in zip(micro, split_features(list(range(5)), 2), strict=True):
        assert set(part) == set(batch)
        for key in batch:
            assert torch.equal(part[key], batch[key][rows]), key
    for key in batch:
        assert torch.equal(torch.cat([m[key] for m in micro]), batch[key])


def test_split_batch_errors():
    features, batch = _batch([2, 2])
    with pytest.raises(ValueError, match=r"packed batch.*split_features, then pack"):
        split_batch(pack(features), 2)
    with pytest.raises(ValueError, match="cannot split 2 rows into 3"):
        split_batch(batch, 3)
    with pytest.raises(ValueError, match="disagree on the batch size"):
        split_batch({**batch, "labels": batch["labels"][:1]}, 1)
    with pytest.raises(
        TypeError, match=r"batch\['max_seqlen'\] must be a \[batch, \.\.\.\] tensor"
    ):
        split_batch({**batch, "max_seqlen": 4}, 1)
    with pytest.raises(ValueError, match="empty batch"):
        split_batch({}, 1)


def test_split_batch_carries_a_losss_fields_with_their_rows():
    lengths = [3, 1, 4, 1, 5]
    features, _ = _batch(lengths)
    features = [{**f, "advantages": float(i)} for i, f in enumerate(features)]  # per sample
    micro = split_batch(pad_collate(features, pad_token_id=0), 2)
    for part, rows in zip(micro, split_features(list(range(5)), 2), strict=True):
        want = [[float(i)] * lengths[i] + [0.0] * (5 - lengths[i]) for i in rows]
        assert part["advantages"].tolist() == want
