"""`GRPOAdvantage` / `RLOOAdvantage` equal their definitions written out per sample (float64
inputs: 1e-12; float32 lists keep float32, as upstream)."""

import pytest
import torch

from twinkle.advantage import GRPOAdvantage, RLOOAdvantage

R = torch.tensor([0.0, 1.0, 3.0, 0.5, 2.0, 2.0, -1.0, 4.0], dtype=torch.float64)
K = 4


def _groups():
    return R.view(-1, K)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_is_the_group_centred_reward(scale):
    g = _groups()
    centred = g - g.mean(1, keepdim=True)
    div = {"group": g.std(1, keepdim=True) + 1e-8, "batch": R.std() + 1e-8, "none": 1.0}[scale]
    want = (centred / div).reshape(-1)
    torch.testing.assert_close(GRPOAdvantage()(R, K, scale), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_rloo_is_the_reward_minus_the_others_mean(scale):
    g = _groups()
    others = torch.stack(
        [torch.stack([(row.sum() - row[i]) / (K - 1) for i in range(K)]) for row in g]
    )
    div = {"group": g.std(1, keepdim=True) + 1e-8, "batch": R.std() + 1e-8, "none": 1.0}[scale]
    want = ((g - others) / div).reshape(-1)
    torch.testing.assert_close(RLOOAdvantage()(R, K, scale), want, rtol=1e-12, atol=1e-12)


def test_upstream_rules_for_one_generation_and_lists():
    r = [1.0, 3.0, 5.0]
    assert torch.equal(GRPOAdvantage()(r, 1), torch.tensor(r))
    assert torch.equal(GRPOAdvantage()(r, 1, "none"), torch.tensor([-2.0, 0.0, 2.0]))
    assert GRPOAdvantage()(r, 1).dtype == torch.float32
    assert torch.equal(GRPOAdvantage()([5.0], 1, "batch"), torch.zeros(1))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="num_generations=3 must be an int >= 1 dividing the 8"):
        GRPOAdvantage()(R, 3)
    with pytest.raises(ValueError, match=">= 2"):
        RLOOAdvantage()(R, 1)
    with pytest.raises(ValueError, match="scale"):
        GRPOAdvantage()(R, K, "rows")
