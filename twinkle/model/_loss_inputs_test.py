"""Per-sample loss inputs become per-token batch fields aligned with each sample's labels, on
features and on a collated batch alike; what a loss lacks or cannot align is refused."""

import pytest
import torch

from twinkle.loss import BNPOLoss, CrossEntropyLoss, GRPOLoss, PPOLoss
from twinkle.model._loss_inputs import with_loss_inputs
from twinkle_fn.data import pad_collate

FEATURES = [
    {"input_ids": [5, 6, 7, 8], "labels": [-100, 7, 8, -100]},
    {"input_ids": [1, 2, 3], "labels": [2, 3, -100]},
]
OLD = [[-1.0, -2.0], [-3.0, -4.0]]  # response-only: one per supervised token


def test_features_get_per_token_fields_and_sequence_weights():
    out = with_loss_inputs(GRPOLoss(), FEATURES, {"advantages": [0.5, -1.0], "old_logps": OLD})
    assert out[0]["old_logps"].tolist() == [0.0, -1.0, -2.0, 0.0]
    assert out[1]["old_logps"].tolist() == [-3.0, -4.0, 0.0]
    assert out[0]["advantages"].tolist() == [0.0, 0.5, 0.5, 0.0]
    assert [f["loss_weights"] for f in out] == [1.0, 1.0]  # 2 and 2 tokens: equal weights
    assert "advantages" not in FEATURES[0]  # copies


def test_a_collated_batch_gets_the_same_fields():
    given = {"advantages": [0.5, -1.0], "old_logps": OLD}
    batch = with_loss_inputs(GRPOLoss(), pad_collate(FEATURES, 0), given)
    from_features = pad_collate(with_loss_inputs(GRPOLoss(), FEATURES, given), 0)
    for name in ("advantages", "old_logps"):
        assert torch.equal(batch[name], from_features[name])
    mask = batch["labels"] != -100
    assert torch.equal(batch["loss_weights"][mask], from_features["loss_weights"][mask])


def test_token_mean_needs_no_weights_and_cross_entropy_reads_nothing():
    out = with_loss_inputs(BNPOLoss(), FEATURES, {"advantages": [1.0, 1.0], "old_logps": OLD})
    assert "loss_weights" not in out[0]
    assert with_loss_inputs(CrossEntropyLoss(), FEATURES, {}) is FEATURES
    with pytest.raises(TypeError, match=r"got \['advantages'\].*CrossEntropyLoss"):
        with_loss_inputs(CrossEntropyLoss(), FEATURES, {"advantages": [1.0, 1.0]})


def test_missing_or_misaligned_inputs_are_refused():
    with pytest.raises(ValueError, match="needs old_logps"):
        with_loss_inputs(GRPOLoss(), FEATURES, {"advantages": [1.0, 1.0]})
    with pytest.raises(ValueError, match=r"beta=0\.1.*needs ref_logps.*set beta=0"):
        with_loss_inputs(GRPOLoss(beta=0.1), FEATURES, {"advantages": [1, 1], "old_logps": OLD})
    bad = {"advantages": [1, 1], "old_logps": [[0, 0, 0], OLD[1]]}
    with pytest.raises(ValueError, match=r"old_logps\[0\] has 3 values.*2 supervised tokens of 4"):
        with_loss_inputs(GRPOLoss(), FEATURES, bad)
    packed = {name: torch.ones(1, 7) for name in ("input_ids", "labels", "advantages", "old_logps")}
    with pytest.raises(ValueError, match="packed batch"):
        with_loss_inputs(GRPOLoss(), {**packed, "cu_seqlens": torch.tensor([0, 4, 7])}, {})


def test_ppo_loss_options_name_their_inputs():
    given = {"advantages": [1.0, 1.0], "old_logps": OLD}
    with pytest.raises(ValueError, match=r"needs rollout_logps.*tis_cap=None"):
        with_loss_inputs(PPOLoss(tis_cap=2.0), FEATURES, given)
    out = with_loss_inputs(PPOLoss(tis_cap=2.0), FEATURES, {**given, "rollout_logps": [0.5, 0.5]})
    assert out[1]["rollout_logps"].tolist() == [0.5, 0.5, 0.0]
