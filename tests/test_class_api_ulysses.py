"""The class API with ``DeviceMesh.from_sizes(ulysses_size=2)`` on 2 real gloo ranks equals one
process (upstream's ``sp_fsdp_dense`` recipe, dense model, no LoRA, one spawn)."""

import pytest
import torch

from twinkle import DeviceMesh
from twinkle.dataloader import DataLoader
from twinkle.model import TransformersModel
from twinkle_fn.testing import random_features, tiny_config
from twinkle_fn.testing_dist import spawn

BATCH, STEPS = 4, 2


def _train(ulysses_size: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """STEPS AdamW steps of BATCH rows (odd lengths, right-padded); losses and final weights."""
    torch.set_num_threads(1)  # two ranks on a shared CPU: intra-op threads only contend
    mesh = DeviceMesh.from_sizes(ulysses_size=ulysses_size)
    model = TransformersModel(
        config=tiny_config(), device_mesh=mesh, mixed_precision="no", dtype=torch.float64, seed=0
    )
    model.set_optimizer("AdamW", lr=1e-2)
    losses = []
    features = random_features(BATCH * STEPS, seed=5, min_len=5, max_len=13)
    for batch in DataLoader(features, batch_size=BATCH, device_mesh=mesh):
        model.forward_backward(inputs=batch)
        model.clip_grad_and_step(max_grad_norm=1.0)
        losses.append(model.calculate_metric()["loss"])
    return losses, model.get_state_dict()


def test_ulysses_size_2_matches_one_process():
    """float64: losses to 1e-12 and weights after 2 steps to 1e-9, as the core's parity test
    (`twinkle_fn/backends/transformers/ulysses_test.py`)."""
    ref_losses, ref_weights = _train(1)
    for losses, weights in spawn(_train, 2, 2):
        assert losses == pytest.approx(ref_losses, rel=1e-12)
        for name, w in weights.items():
            torch.testing.assert_close(w, ref_weights[name], rtol=1e-9, atol=1e-11, msg=name)
