"""`twinkle train --config` end to end on CPU: the documented configs on both backends, resume,
stop signals and the metrics file.

One module-scoped set of runs (the tiny default model, 4 steps of 4 samples) serves every test:
for each backend, examples/train_<backend>.yaml straight through with a checkpoint every step,
and the same run resumed from its step-2 checkpoint.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from twinkle.cli import checkpoints as ckpts
from twinkle.cli import config as cfg
from twinkle.cli import main

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("transformers", "megatron")
# The examples run 300 steps of 32 samples; the tests shrink the run, never its other keys.
TINY = ["--steps", "4", "--batch-size", "4", "--num-samples", "40", "--warmup-steps", "1"]
TINY += ["--save-steps", "1", "--keep-last", "2", "--eval-steps", "2", "--no-progress"]


def example(backend: str) -> Path:
    return ROOT / "examples" / f"train_{backend}.yaml"


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(out) if "loss" in r}


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "checkpoint" / "model.safetensors")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """backend -> (straight run's output, resumed run's output)."""
    base = tmp_path_factory.mktemp("launcher")
    out = {}
    for backend in BACKENDS:
        straight, resumed = base / backend, base / f"{backend}-resumed"
        args = ["train", "--config", str(example(backend)), *TINY]
        assert main([*args, "--output-dir", str(straight)]) == 0
        step2 = ckpts.periodic_dir(straight, 2)
        assert main([*args, "--output-dir", str(resumed), "--resume", str(step2)]) == 0
        out[backend] = straight, resumed
    return out


def test_both_backends_give_the_same_loss_curve(runs):
    """The same config on megatron-core and on transformers: float32 throughout, the same init
    (the HF module, bridged), data order and AdamW update; only summation orders differ (fused
    vs unfused loss, flat vs per-tensor optimizer). Observed: losses equal to 1e-7 relative,
    grad norms to 2e-7; rtol 1e-5 leaves room for BLAS differences between machines. Weights:
    Adam divides by the root of the second moment, so the rounding of a near-zero gradient moves
    an update by up to a fraction of the lr (3e-3); observed max 1.2e-6 (a norm weight), atol
    1e-5 is 0.3% of one lr step."""
    hf, meg = (records(runs[b][0]) for b in BACKENDS)
    assert [r["step"] for r in hf] == [r["step"] for r in meg]
    for a, b in zip(hf, meg, strict=True):
        for key in ("loss", "grad_norm", "eval_loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5), (a, b)
    assert losses(runs["transformers"][0])[4] < losses(runs["transformers"][0])[1]
    for name, w in weights(runs["transformers"][0]).items():
        torch.testing.assert_close(weights(runs["megatron"][0])[name], w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_continues_bit_exactly(runs, backend):
    """4 steps straight vs 2 steps + resume from the step-2 checkpoint + 2 steps: the same losses
    and the same final weights, bit for bit (model, optimizer moments, schedule, RNG and data
    position all restored: any one of them off changes steps 3 and 4)."""
    straight, resumed = runs[backend]
    assert losses(resumed) == {s: v for s, v in losses(straight).items() if s > 2}
    ref = weights(straight)
    got = weights(resumed)
    assert got.keys() == ref.keys()
    assert all(torch.equal(got[n], ref[n]) for n in ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_periodic_checkpoints_keep_the_last_n_and_the_config_is_written(runs, backend):
    straight = runs[backend][0]
    kept = sorted(p.name for p in (straight / "checkpoints").iterdir())
    assert kept == ["step-2", "step-3"]  # step 1 pruned; step 4 is the final checkpoint
    assert ckpts.resume_path("latest", straight) == straight / "checkpoint"
    written = cfg.build(yaml.safe_load((straight / "config.yaml").read_text()))
    assert written.backend == backend and written.schedule.steps == 4
    assert written.cadence == cfg.CadenceConfig(save_steps=1, keep_last=2, eval_steps=2)


def test_metrics_file_holds_every_field_each_step(runs):
    out = runs["transformers"][0]
    rows = records(out)
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert set(r) == {
            "step",
            "loss",
            "grad_norm",
            "lr",
            "tokens",
            "tokens_per_s",
            "mfu",
            "memory_gb",
        }
        assert r["grad_norm"] > 0 and r["tokens"] > 0 and r["tokens_per_s"] > 0
        assert r["memory_gb"] > 0 and r["mfu"] is None  # no known peak on CPU
    assert [r["lr"] for r in steps[:2]] == [0.0, 3e-3]  # warmup of 1 step, then the peak
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4]
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        assert not (out / "tensorboard").exists()
    else:
        assert any((out / "tensorboard").iterdir())


def test_a_lora_run_trains_only_the_adapter_and_writes_it_for_peft(tmp_path):
    """`--lora` on the transformers backend: the base weights in the checkpoints of steps 1 and 2
    are bit-identical, the adapter's B matrices (zero at init) moved, and ``adapter/`` holds
    only LoRA tensors."""
    args = ["train", "--config", str(example("transformers")), *TINY, "--steps", "3"]
    args += ["--lora", "r=4,alpha=8,targets=all-linear", "--output-dir", str(tmp_path)]
    assert main(args) == 0
    one, two = (load_file(ckpts.periodic_dir(tmp_path, s) / "model.safetensors") for s in (1, 2))
    base = [n for n in one if "lora_" not in n]
    lora_b = [n for n in one if "lora_B" in n]
    assert base and lora_b and all(torch.equal(one[n], two[n]) for n in base)
    assert all(not torch.equal(one[n], two[n]) for n in lora_b)
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert adapter and all("lora_" in n for n in adapter)
    assert cfg.build(yaml.safe_load((tmp_path / "config.yaml").read_text())).lora.r == 4


def test_a_megatron_lora_run_saves_and_resumes_its_training_state_bit_exactly(tmp_path):
    """`--lora` on megatron: periodic checkpoints hold the adapters' training state, so 4 steps
    straight equal 2 steps + resume from the step-2 checkpoint + 2 steps: the same losses and
    the same final adapter, bit for bit."""
    args = ["train", "--config", str(example("megatron")), *TINY]
    args += ["--lora", "r=4,alpha=8,targets=all-linear"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main([*args, "--output-dir", str(straight)]) == 0
    step2 = ckpts.periodic_dir(straight, 2)
    assert main([*args, "--output-dir", str(resumed), "--resume", str(step2)]) == 0
    assert losses(resumed) == {s: v for s, v in losses(straight).items() if s > 2}
    ref, got = (
        load_file(out / "adapter" / "adapter_model.safetensors") for out in (straight, resumed)
    )
    assert ref and got.keys() == ref.keys() and all(torch.equal(got[n], ref[n]) for n in ref)


def test_the_megatron_block_starts_from_a_dist_checkpoint_with_offload_on(runs, tmp_path):
    """``use_dist_checkpointing`` + ``dist_checkpointing_path``: the run starts from that
    checkpoint's weights (its held-out loss before training is the straight run's last, the
    same weights evaluated the same way), and the three offload switches train through."""
    start = runs["megatron"][0] / "checkpoint"
    args = ["train", "--config", str(example("megatron")), *TINY, "--steps", "1"]
    args += ["--warmup-steps", "0", "--save-steps", "0", "--output-dir", str(tmp_path)]
    for key in ("use_dist_checkpointing", "param_offload", "grad_offload", "optimizer_offload"):
        args += ["--set", f"megatron.{key}=true"]
    assert main([*args, "--set", f"megatron.dist_checkpointing_path={start}"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    last_eval = [r["eval_loss"] for r in records(runs["megatron"][0]) if "eval_loss" in r][-1]
    assert summary["heldout_loss_before"] == pytest.approx(last_eval, rel=1e-6)


def _launch(out: Path, steps: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "twinkle.cli", "train", *TINY, "--steps", steps]
    argv += ["--save-steps", "0", "--output-dir", str(out)]
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for_a_step(proc: subprocess.Popen, out: Path) -> None:
    deadline = time.monotonic() + 120
    while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_a_signal_saves_a_checkpoint_and_exits_0_a_second_exits_at_once(tmp_path):
    """Two runs of 100000 steps: one gets SIGTERM, the other SIGTERM and SIGINT together."""
    once, twice = tmp_path / "once", tmp_path / "twice"
    procs = {once: _launch(once, "100000"), twice: _launch(twice, "100000")}
    for out, proc in procs.items():
        _wait_for_a_step(proc, out)
    procs[once].send_signal(signal.SIGTERM)
    procs[twice].send_signal(signal.SIGTERM)
    procs[twice].send_signal(signal.SIGINT)
    outs = {out: proc.communicate(timeout=120) for out, proc in procs.items()}
    assert procs[once].returncode == 0, outs[once]
    assert b"stopped by a signal after step" in outs[once][0]
    last = max(losses(once))
    assert ckpts.resume_path("latest", once) == ckpts.periodic_dir(once, last)
    assert procs[twice].returncode in (128 + signal.SIGINT, 128 + signal.SIGTERM)
    assert not (twice / "checkpoints").exists()


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_readme_shows_each_example_as_the_tests_run_it(backend):
    readme = (ROOT / "README.md").read_text()
    assert f"```yaml\n{example(backend).read_text()}```" in readme
