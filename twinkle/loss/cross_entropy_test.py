"""`CrossEntropyLoss` called as upstream's equals the core's `cross_entropy_sum` (float64:
1e-12), from logits or log-probs, of any leading shape; DFT is refused."""

import pytest
import torch

from twinkle.loss import CrossEntropyLoss
from twinkle_fn.losses import cross_entropy_sum


def _data():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, dtype=torch.float64, generator=g)
    labels = torch.randint(0, 7, (2, 5), generator=g)
    labels[0, :2] = -100
    return logits, labels


def test_mean_and_sum_equal_the_core():
    logits, labels = _data()
    want = cross_entropy_sum(logits, labels)
    logps = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    mean = CrossEntropyLoss()({"labels": labels}, {"logits": logits})
    torch.testing.assert_close(mean["loss"], want.loss_sum / want.num_tokens, rtol=1e-12, atol=0)
    assert mean["num_tokens"] == 0
    summed = CrossEntropyLoss(reduction="sum")({"labels": labels.flatten()}, {"logps": logps})
    torch.testing.assert_close(summed["loss"], want.loss_sum, rtol=1e-12, atol=0)
    assert int(summed["num_tokens"]) == int(want.num_tokens) == 8


def test_unsupported_options_are_refused():
    with pytest.raises(ValueError, match="DFT"):
        CrossEntropyLoss(dft=True)
    with pytest.raises(ValueError, match="reduction"):
        CrossEntropyLoss(reduction="none")
