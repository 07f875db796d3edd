"""`megatron_optimizer` refuses what it cannot run; its training behaviour (lr schedule, fp32
master weights, fp16 overflow skips) is checked end to end in `megatron_test.py`."""

import pytest
import torch

from twinkle_fn.backends.megatron.optimizer import megatron_optimizer


def test_megatron_optimizer_needs_a_megatron_model():
    with pytest.raises(TypeError, match="prepared by the megatron backend"):
        megatron_optimizer(1e-3).init({"w": torch.zeros(2)})
    with pytest.raises(ValueError, match="b1"):
        megatron_optimizer(1e-3, b1=1.0)
