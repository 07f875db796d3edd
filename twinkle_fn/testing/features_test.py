"""The random test features: labels shifted with a masked prompt, deterministic per seed, and
the added loss fields leaving the inputs alone and exact in float32 (collation's dtype)."""

import copy

import pytest
import torch

from twinkle_fn.testing.features import (
    random_features,
    with_advantages,
    with_loss_scale,
    with_rl_fields,
    with_value_fields,
)


def test_random_features_are_the_ids_shifted_after_a_masked_prompt():
    feats = random_features(50, seed=1)
    assert feats == random_features(50, seed=1) and feats != random_features(50, seed=2)
    for f in feats:
        ids, labels = f["input_ids"], f["labels"]
        assert 3 <= len(ids) <= 12 and len(labels) == len(ids) and labels[-1] == -100
        assert all(0 < i < 96 for i in ids)
        masked = next(j for j, x in enumerate([*labels[:-1], 0]) if x != -100)
        assert masked <= len(ids) // 3 and masked < len(ids) - 1  # a supervised token is left
        assert labels[masked:-1] == ids[masked + 1 :]


@pytest.mark.parametrize(
    "add", [with_advantages, with_value_fields, with_rl_fields, with_loss_scale]
)
def test_added_fields_leave_the_inputs_alone_and_are_exact_in_float32(add):
    feats = random_features(8, seed=3)
    before = copy.deepcopy(feats)
    out = add(feats, seed=5)
    assert feats == before and out == add(feats, seed=5)
    for f, g in zip(feats, out, strict=True):
        assert {k: g[k] for k in f} == f
        for name in g.keys() - f.keys():
            values = g[name] if isinstance(g[name], list) else [g[name]]
            assert len(values) == (len(f["input_ids"]) if isinstance(g[name], list) else 1)
            exact = torch.tensor(values, dtype=torch.float64)
            assert torch.equal(exact.float().double(), exact), name


def test_rl_fields_lie_in_their_stated_ranges():
    for f in with_rl_fields(random_features(8), seed=2):
        assert all(-1 <= a < 1 for a in f["advantages"])
        for name in ("old_logps", "ref_logps", "rollout_logps"):
            assert all(-5.5 <= x < -3.5 for x in f[name]), name
        assert f["loss_weights"] > 0
    for f in with_value_fields(random_features(8), seed=2):
        assert all(-1 <= r < 1 for r in f["returns"])
        assert all(abs(v) <= 0.375 for v in f["old_values"])
    for f in with_loss_scale(random_features(8), seed=2):
        assert set(f["loss_scale"]) <= {k / 4 for k in range(9)}
