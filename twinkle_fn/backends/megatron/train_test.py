"""The loss with the padded vocabulary masked.

The schedule itself (`forward_backward`) is checked end to end by the megatron backend's parity
tests (`twinkle_fn/backends/megatron/backend_test.py`).
"""

import pytest
import torch
import torch.nn.functional as F

from twinkle_fn.backends.megatron.train import (
    mask_padded_vocab_,
    token_losses,
)


@pytest.mark.parametrize(("vocab", "tp_rank", "real"), [(10, 0, 8), (10, 1, 2), (10, 2, 0)])
def test_mask_padded_vocab_hides_ids_beyond_the_vocabulary(vocab, tp_rank, real):
    logits = torch.randn(3, 2, 8)
    out = mask_padded_vocab_(logits.clone(), vocab, tp_rank)
    assert torch.equal(out[..., :real], logits[..., :real])
    assert (out[..., real:] == float("-inf")).all()


def test_token_losses_equal_cross_entropy_over_the_real_vocabulary(megatron_world):
    """Padding columns carry huge logits here: unmasked, they would take all the softmax mass."""
    vocab, padded, hidden = 10, 16, 6
    weight = torch.randn(padded, hidden)
    weight[vocab:] = 50.0
    h = torch.randn(4, 2, hidden)  # [s, b, hidden]
    labels = torch.randint(0, vocab, (2, 4))
    labels[0, 1] = -100

    def output_layer(x, weight):
        return x @ weight.t(), None

    got = token_losses(
        hidden_states=h, output_layer=output_layer, output_weight=weight, labels=labels, context=10
    )
    logits = (h @ weight[:vocab].t()).transpose(0, 1)  # [b, s, vocab]
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(2, 4)
    keep = labels != -100
    # megatron's cross entropy runs in float32: 1e-5
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-5, atol=1e-5)
