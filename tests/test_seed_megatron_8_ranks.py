"""Upstream's `MegatronModel` usage example on its own mesh, dp 2 x tp 2 x pp 2: 8 gloo ranks.

The docs' example (`cookbook/megatron_tp.py`) on 8 real processes must give, step for step, the
losses of the same script on one process: the mesh only changes the order of sums. float32
(megatron's distributed optimizer has no float64 path): relative 1e-5 on losses (observed ~1e-7).
Marked slow: 8 processes each import megatron-core on a 2-core machine (about two minutes).
"""

import runpy
from pathlib import Path

import pytest
import torch

from twinkle_fn.testing_dist import spawn

COOKBOOK = Path(__file__).resolve().parent.parent / "cookbook"
EXAMPLE = dict(num_samples=32, batch_size=8, gradient_accumulation_steps=2, lr=1e-3)


def _example(model_dir, sizes):
    torch.set_num_threads(1)  # 8 ranks on 2 cores: intra-op threads only contend
    run = runpy.run_path(str(COOKBOOK / "megatron_tp.py"))["run"]
    return run(model_dir, **sizes, **EXAMPLE)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    make = runpy.run_path(str(COOKBOOK / "make_tiny_model.py"))["make_tiny_model"]
    return str(make(tmp_path_factory.mktemp("tiny") / "model", hidden_size=32))


@pytest.mark.slow
def test_seed_mesh_dp2_tp2_pp2_matches_one_process(model_dir):
    (one,) = spawn(_example, 1, model_dir, {}, timeout_s=300)
    eight = spawn(_example, 8, model_dir, dict(dp_size=2, tp_size=2, pp_size=2), timeout_s=600)
    assert len(one) == EXAMPLE["num_samples"] // EXAMPLE["batch_size"] // 2
    for losses in eight:  # every rank reports the globally reduced loss
        assert losses == pytest.approx(one, rel=1e-5)
    assert one[-1] < one[0]
