"""GRPO through the class API on 2 gloo ranks (fsdp 2) equals one process on all the samples:
the loss's sequence weights span every data rank's samples of the call.

Float64 (``dtype=torch.float64``): the ranks differ from one process by the order of the
gradient reduction only, so the loss and the gradient norm agree to 1e-12 and the weights to
1e-10. The two ranks' samples have unequal token counts (12 and 15), so weights taken from each
rank's samples alone (each rank's sequence mean, weighted by its tokens) give another loss.
"""

import pytest
import torch

from twinkle import DeviceMesh
from twinkle.model import TransformersModel
from twinkle_fn.testing import random_features, tiny_config
from twinkle_fn.testing_dist import spawn

LR = 1e-2
ADVANTAGES = [1.0, -0.5, 0.25, -1.0]


def _features():
    return random_features(4, seed=11)


def _old_logps(features):
    """Response-only per-token lists (a sampler's form)."""
    return [
        [-3.0 - (i + t) % 7 / 8 for t, label in enumerate(f["labels"]) if label != -100]
        for i, f in enumerate(features)
    ]


def _grpo_step(sizes):
    """One GRPO step of a float64 TransformersModel on this rank's share of the features.
    Returns the step's metrics and the weights."""
    torch.set_num_threads(1)  # ranks share a small CPU
    mesh = DeviceMesh.from_sizes(**sizes)
    model = TransformersModel(
        config=tiny_config(), device_mesh=mesh, mixed_precision="no", dtype=torch.float64, seed=0
    )
    model.set_optimizer("AdamW", lr=LR)
    model.set_loss("GRPOLoss", epsilon=0.2, beta=0.04)
    mine = mesh.get_slice(len(ADVANTAGES))
    feats = _features()[mine]
    ref = model.forward_only(inputs=feats)["logps"]
    old = _old_logps(_features())[mine]
    model.forward_backward(inputs=feats, advantages=ADVANTAGES[mine], old_logps=old, ref_logps=ref)
    model.step()
    return model.calculate_metric(), model.get_state_dict()


def test_two_data_ranks_take_the_sequence_mean_over_both():
    lengths = [sum(x != -100 for x in f["labels"]) for f in _features()]
    assert sum(lengths[:2]) != sum(lengths[2:])
    one_metrics, one_params = _grpo_step({})
    for metrics, params in spawn(_grpo_step, 2, {"fsdp_size": 2}, timeout_s=300):
        assert metrics["loss"] == pytest.approx(one_metrics["loss"], rel=1e-12)
        assert metrics["grad_norm"] == pytest.approx(one_metrics["grad_norm"], rel=1e-12)
        for name, want in one_params.items():
            torch.testing.assert_close(params[name], want, rtol=1e-10, atol=1e-10, msg=name)
