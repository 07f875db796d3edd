"""`benchmarks.one_gpu` keeps running on CPU (GPU-only rows skipped); timings are never asserted."""

import json
import math

import pytest

from benchmarks import one_gpu
from twinkle_fn import backends

_TINY = ["--shape", "tiny", "--seq", "32", "--batch", "2", "--steps", "2", "--warmup", "1"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("one_gpu") / "lora.json"
    return one_gpu.main([*_TINY, "--workload", "lora", "--device", "cpu", "--json", str(out)]), out


def test_lora_run_reports_every_row_and_writes_the_same_json(lora_run):
    result, out = lora_run
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert list(result["rows"]) == list(one_gpu.WORKLOADS["lora"])
    assert result["tokens_per_step"] == 2 * 32
    for name, row in result["rows"].items():
        if "compiled" in name:
            assert row["status"] == "skipped"


@pytest.mark.parametrize("name", ["peft_eager", "twinkle_transformers", "twinkle_megatron"])
def test_lora_rows_train_the_same_task(lora_run, name):
    """Every row starts from a random init with the adapters' B at zero, so its loss is about
    ln(vocab) (0.1: init noise)."""
    if "megatron" in name and "megatron" not in backends.names():
        pytest.skip("no megatron backend in twinkle_fn.backends")
    row = lora_run[0]["rows"][name]
    assert row["status"] == "ok", row
    assert row["tokens_per_s"] > 0 and row["peak_mem_gib"] is None
    assert row["first_loss"] == pytest.approx(math.log(512), abs=0.1)
    assert row["last_loss"] == pytest.approx(math.log(512), abs=0.1)


def test_rows_outside_the_workload_are_refused():
    with pytest.raises(SystemExit, match="not in workload"):
        one_gpu.main([*_TINY, "--rows", "nope", "--device", "cpu", "--json", ""])


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("one_gpu") / "full.json"
    return one_gpu.main([*_TINY, "--workload", "full", "--device", "cpu", "--json", str(out)])


def test_full_rows_train_the_same_task(full_run):
    assert list(full_run["rows"]) == list(one_gpu.WORKLOADS["full"])
    for name, row in full_run["rows"].items():
        if "compiled" in name or ("megatron" in name and "megatron" not in backends.names()):
            assert row["status"] == "skipped"
            continue
        assert row["status"] == "ok", (name, row)
        assert row["first_loss"] == pytest.approx(math.log(512), abs=0.1)


def test_load_rows_report_seconds_and_rates(tmp_path):
    ckpt = tmp_path / "ckpt"
    result = one_gpu.main(
        [
            "--workload",
            "load",
            "--shape",
            "tiny",
            "--device",
            "cpu",
            "--checkpoint",
            str(ckpt),
            "--json",
            "",
        ]
    )
    assert (ckpt / "config.json").is_file() and result["checkpoint_gib"] > 0
    assert list(result["rows"]) == list(one_gpu.WORKLOADS["load"])
    for name, row in result["rows"].items():
        if "megatron" in name and "megatron" not in backends.names():
            continue
        assert row["status"] == "ok", (name, row)
        assert row["total_s"] == pytest.approx(row["load_s"] + row["init_s"])
        assert row["gb_per_s"] > 0
