"""GRPO's group-normalised advantages against a float64 reference written out per group."""

import statistics

import pytest
import torch

from twinkle_fn.losses import group_advantages


@pytest.mark.parametrize("normalize", ["std", "none"])
def test_each_group_is_centred_and_scaled_by_its_own_spread(normalize):
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.25, 3.0, 3.0, 3.0, -1.0, 2.0, 0.0]
    got = group_advantages(rewards, 4, normalize, eps=1e-6)
    want = []
    for g in range(0, 12, 4):
        group = rewards[g : g + 4]
        mean, std = statistics.fmean(group), statistics.stdev(group)
        want += [(r - mean) / (std + 1e-6 if normalize == "std" else 1.0) for r in group]
    assert got.dtype == torch.float64 and got.shape == (12,)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_a_group_of_equal_rewards_has_no_advantage():
    assert torch.equal(group_advantages([2.0, 2.0, 2.0], 3), torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([1.0, 2.0, 3.0], 2), "do not split into groups of 2"),
        (([1.0, 2.0], 1), "needs group_size >= 2"),
        (([1.0, 2.0], 0), "group_size must be an int >= 1"),
        (([1.0, float("nan")], 2), "finite numbers"),
        (([[1.0, 2.0]], 2), "flat sequence"),
        (([1.0, 2.0], 2, "max"), "normalize must be one of"),
    ],
)
def test_bad_input_is_refused(args, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(*args)
