import pytest
import torch

from twinkle_fn.data.collate import (
    IGNORE_INDEX,
    check_features,
    check_supervised,
    num_supervised_tokens,
    pad_collate,
)

FEATURES = [
    {"input_ids": [5, 6, 7], "labels": [6, 7, IGNORE_INDEX]},
    {"input_ids": [8], "labels": [IGNORE_INDEX]},
    {"input_ids": [9, 10, 11, 12, 13], "labels": [IGNORE_INDEX, 11, 12, 13, IGNORE_INDEX]},
]


def test_pad_collate_matches_hand_built_batch():
    batch = pad_collate(FEATURES, pad_token_id=0)
    pad = IGNORE_INDEX
    expected = {
        "input_ids": [[5, 6, 7, 0, 0], [8, 0, 0, 0, 0], [9, 10, 11, 12, 13]],
        "labels": [[6, 7, pad, pad, pad], [pad] * 5, [pad, 11, 12, 13, pad]],
        "attention_mask": [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]],
        "position_ids": [[0, 1, 2, 0, 0], [0, 0, 0, 0, 0], [0, 1, 2, 3, 4]],
    }
    assert set(batch) == set(expected)
    for key, value in expected.items():
        assert batch[key].dtype == torch.int64, key
        assert batch[key].tolist() == value, key


def test_pad_to_multiple_of_rounds_up_and_pads():
    batch = pad_collate(FEATURES, pad_token_id=3, pad_to_multiple_of=4)
    assert batch["input_ids"].shape == (3, 8)
    assert batch["input_ids"][2, 5:].tolist() == [3, 3, 3]
    assert batch["labels"][2, 5:].tolist() == [IGNORE_INDEX] * 3
    assert batch["attention_mask"].sum(1).tolist() == [3, 1, 5]
    exact = pad_collate(FEATURES[2:], pad_token_id=3, pad_to_multiple_of=5)
    assert exact["input_ids"].shape == (1, 5)


@pytest.mark.parametrize(
    ("features", "error", "match"),
    [
        ([], ValueError, "empty"),
        ({"input_ids": [1], "labels": [1]}, TypeError, "list of features"),
        ([[1, 2]], TypeError, r"features\[0\] must be a dict"),
        ([{"input_ids": [1]}], ValueError, r"features\[0\] has no 'labels'"),
        ([{"input_ids": [1, 2], "labels": [1]}], ValueError, "2 input_ids but 1 labels"),
        ([{"input_ids": [], "labels": []}], ValueError, r"features\[0\]\['input_ids'\] is empty"),
        (
            [{"input_ids": [1.0], "labels": [1]}],
            TypeError,
            r"\['input_ids'\] must be a list of ints",
        ),
        ([{"input_ids": [1], "labels": "a"}], TypeError, r"\['labels'\] must be a list of ints"),
    ],
)
def test_malformed_features_raise(features, error, match):
    with pytest.raises(error, match=match):
        check_features(features)
    with pytest.raises(error, match=match):
        pad_collate(features, pad_token_id=0)


def test_pad_collate_rejects_bad_arguments():
    with pytest.raises(TypeError, match="pad_token_id"):
        pad_collate(FEATURES, pad_token_id=None)
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        pad_collate(FEATURES, pad_token_id=0, pad_to_multiple_of=0)


def test_num_supervised_tokens_counts_non_ignored_labels():
    batch = pad_collate(FEATURES, pad_token_id=0)
    assert num_supervised_tokens(batch) == 5
    assert num_supervised_tokens({"labels": [[1, IGNORE_INDEX, 0]]}) == 2
    with pytest.raises(ValueError, match="no 'labels'"):
        num_supervised_tokens({"input_ids": batch["input_ids"]})


def test_check_supervised_accepts_supervised_batch_and_features():
    check_supervised(pad_collate(FEATURES[:1], pad_token_id=0))
    check_supervised(FEATURES[:1])


def test_check_supervised_raises_on_fully_masked_batch():
    batch = pad_collate(FEATURES[1:2], pad_token_id=0)
    with pytest.raises(ValueError, match="step 3 has no supervised token: every label is -100"):
        check_supervised(batch, where="step 3")


def test_check_supervised_names_the_unsupervised_feature():
    with pytest.raises(ValueError, match=r"features\[1\] has no supervised token.*max_length"):
        check_supervised(FEATURES, where="features")


def test_check_supervised_refuses_device_tensors():
    labels = torch.zeros(1, 2, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="before moving it to the device"):
        check_supervised({"labels": labels})
    with pytest.raises(ValueError, match="no 'labels'"):
        check_supervised({"input_ids": labels})


def _with_fields():
    """FEATURES with a per-token float field, a per-sample number, a per-sample flag, and text
    (which is no batch field)."""
    return [
        {
            **f,
            "old_logps": [-0.5 * (t + 1) for t in range(len(f["input_ids"]))],
            "reward": r,
            "keep": r > 0,
            "prompt": "text",
        }
        for f, r in zip(FEATURES, (1.5, -2, 3), strict=True)
    ]


def test_pad_collate_carries_per_token_and_per_sample_fields_padded_with_zeros():
    batch = pad_collate(_with_fields(), pad_token_id=0, pad_to_multiple_of=3)
    assert set(batch) == {
        "input_ids",
        "labels",
        "attention_mask",
        "position_ids",
        "old_logps",
        "reward",
        "keep",
    }
    assert batch["old_logps"].dtype == torch.float32 and batch["old_logps"].shape == (3, 6)
    assert batch["old_logps"].tolist() == [
        [-0.5, -1.0, -1.5, 0, 0, 0],
        [-0.5, 0, 0, 0, 0, 0],
        [-0.5, -1.0, -1.5, -2.0, -2.5, 0],
    ]
    # one number per sample: repeated over its tokens (ints and floats together: float32)
    assert batch["reward"].dtype == torch.float32
    assert batch["reward"].tolist() == [[1.5] * 3 + [0] * 3, [-2] + [0] * 5, [3] * 5 + [0]]
    assert batch["keep"].dtype == torch.bool
    assert batch["keep"].tolist() == [[True] * 3 + [False] * 3, [False] * 6, [True] * 5 + [False]]


def test_a_features_own_layout_keys_are_rebuilt_not_carried():
    feats = [
        {**f, "attention_mask": [1] * len(f["input_ids"]), "position_ids": [7]} for f in FEATURES
    ]
    assert set(pad_collate(feats, pad_token_id=0)) == {
        "input_ids",
        "labels",
        "attention_mask",
        "position_ids",
    }
    assert pad_collate(feats, pad_token_id=0)["position_ids"][0].tolist() == [0, 1, 2, 0, 0]


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (
            lambda f: f[1].update(old_logps=[0.0, 1.0]),
            ValueError,
            r"features\[1\]\['old_logps'\] has 2 values but the sample has 1 tokens",
        ),
        (
            lambda f: f[2].pop("reward"),
            ValueError,
            r"features\[2\] has no number\(s\) for 'reward'",
        ),
        (lambda f: f[0].update(reward=None), ValueError, r"features\[0\] has no number"),
        (
            lambda f: f[0].update(reward=[[1.0]] * 3),
            TypeError,
            r"\['reward'\] must be a number or a flat",
        ),
        (
            lambda f: f[0].update(reward=["a", "b", "c"]),
            TypeError,
            r"\['reward'\] must be a number",
        ),
    ],
    ids=["misaligned", "missing", "none", "nested", "text list"],
)
def test_fields_that_cannot_be_collated_are_named(change, error, match):
    feats = _with_fields()
    change(feats)
    with pytest.raises(error, match=match):
        pad_collate(feats, pad_token_id=0)
