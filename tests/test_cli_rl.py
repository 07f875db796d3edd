"""`twinkle rl` end to end on CPU: the reward rises, the run's files are written, and bad input
is named before anything is built."""

import json

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from twinkle.cli import main

STEPS = 6


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """The default task and model on transformers; a checkpoint every 3 steps (~15 s of CPU)."""
    out = tmp_path_factory.mktemp("rl")
    args = ["rl", "--steps", str(STEPS), "--save-steps", "3", "--no-progress"]
    assert main([*args, "--output-dir", str(out)]) == 0
    return out


def test_the_held_out_reward_rises(run_dir):
    """Fixed seeds: the digit fraction goes from ~0.11 to ~0.9 in 6 steps of 2 PPO epochs."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["reward_before"] < 0.2
    assert summary["reward_after"] > summary["reward_before"] + 0.4
    assert summary["train_tokens_per_s"] > 0 and summary["sync_gb_per_s"] > 0


def test_the_run_writes_its_config_metrics_and_checkpoints(run_dir):
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["rl"]["group_size"] == 8 and config["rl"]["beta"] == 0.04
    assert config["schedule"]["steps"] == STEPS and config["optimizer"]["lr"] == 1e-2
    records = _records(run_dir)
    steps = [r for r in records if "reward" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert all(r["lr"] == pytest.approx(1e-2) and r["tokens"] > 0 for r in steps)
    assert records[-1] == {"step": STEPS, "eval_reward": pytest.approx(records[-1]["eval_reward"])}
    assert (run_dir / "checkpoints" / "step-3").is_dir()
    model = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoint")
    assert torch.isfinite(model(input_ids=torch.tensor([[1, 2, 3]])).logits).all()


def test_a_resumed_run_continues_bit_exactly(run_dir, tmp_path):
    """From the step-3 checkpoint: the same rollouts (per-step seeds), the same final weights."""
    args = ["rl", "--steps", str(STEPS), "--resume", str(run_dir / "checkpoints" / "step-3")]
    assert main([*args, "--no-progress", "--output-dir", str(tmp_path)]) == 0
    rewards = [r["reward"] for r in _records(tmp_path) if "reward" in r]
    assert rewards == [r["reward"] for r in _records(run_dir) if "reward" in r][3:]
    want = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoint").state_dict()
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint").state_dict()
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_megatron_runs_the_same_command(tmp_path, no_leak):
    args = ["rl", "--backend", "megatron", "--steps", "2", "--no-progress"]
    assert main([*args, "--output-dir", str(tmp_path)]) == 0
    assert len([r for r in _records(tmp_path) if "reward" in r]) == 2
    assert (tmp_path / "checkpoint").is_dir()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--group-size", "1"], "rl block: GRPOConfig.group_size must be >= 2"),
        (["--set", "rl.gruop_size=4"], "unknown key 'rl.gruop_size'; did you mean rl.group_size?"),
        (["--set", "data.path=x.jsonl"], "reads no data block; remove data.{path}"),
        (["--epsilon", "-1"], "epsilon"),
        (["--warmup-steps", "5", "--steps", "5"], "--warmup-steps 5 must be < --steps 5"),
    ],
)
def test_bad_input_is_named_before_anything_is_built(tmp_path, capsys, extra, message):
    assert main(["rl", *extra, "--output-dir", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
