"""The GRPO cookbook (`cookbook/grpo.py`): a short run on CPU raises the mean reward."""

import importlib.util
from pathlib import Path

COOKBOOK = Path(__file__).resolve().parent.parent / "cookbook" / "grpo.py"


def test_grpo_raises_the_mean_reward():
    """Fixed seeds: the digit fraction of held-out samples goes from ~0.08 to over 0.5 in 10
    steps of one PPO epoch (40 s of CPU on 2 cores)."""
    spec = importlib.util.spec_from_file_location("grpo_cookbook", COOKBOOK)
    grpo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grpo)
    out = grpo.run(steps=10, ppo_epochs=1)
    assert out["reward_before"] < 0.2
    assert out["reward_after"] > out["reward_before"] + 0.3
