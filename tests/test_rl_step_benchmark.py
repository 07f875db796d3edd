"""`benchmarks.rl_step` keeps running on CPU on both backends; timings are never asserted."""

import json
import math

import pytest
import torch

from benchmarks import rl_step


@pytest.mark.parametrize("backend", ["transformers", "megatron"])
def test_every_row_runs_and_reports(tmp_path, backend):
    out = tmp_path / "rl.json"
    argv = ["--shape", "tiny", "--seq", "32", "--batch", "2", "--steps", "1", "--warmup", "1"]
    result = rl_step.main([*argv, "--device", "cpu", "--backend", backend, "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    rows = result["rows"]
    assert tuple(rows) == rl_step.ROWS
    assert rows["sft_step"]["x_sft_step"] == 1.0
    # log-probs of a 512-token vocabulary under a random model: near log(1/512), never 0
    assert -10.0 < rows["old_logps"]["output_mean"] < -1.0
    assert all(math.isfinite(rows[name]["output_mean"]) for name in rl_step.STEP_ROWS)
    assert rows["weight_sync"]["gb_per_s"] > 0


def test_the_batch_supervises_the_completion_half_only():
    batch = rl_step.rl_batch(torch.arange(16).reshape(2, 8))
    assert (batch["labels"][:, :4] == -100).all() and (batch["labels"][:, 4:7] >= 0).all()
    # one advantage per sample, broadcast over its tokens
    assert (batch["advantages"] == batch["advantages"][:, :1]).all()
    assert batch["ref_logps"].shape == batch["old_logps"].shape == (2, 8)
