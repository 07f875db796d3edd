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


_FP8_ROWS = ["twinkle_transformers_bf16", "twinkle_transformers_fp8", "twinkle_megatron_fp8"]


@pytest.fixture(scope="module")
def fp8_run():
    rows = [*_FP8_ROWS, "twinkle_transformers_fp8_compiled"]
    return one_gpu.main(
        [*_TINY, "--workload", "fp8", "--device", "cpu", "--json", "", "--rows", *rows]
    )


def test_fp8_rows_train_the_same_task_and_compare_with_bf16(fp8_run):
    """The fp8 rows start from the bf16 row's init (loss about ln(vocab)) and report their speed
    against it; MFU has no peak on a CPU."""
    rows = fp8_run["rows"]
    assert rows["twinkle_transformers_fp8_compiled"]["status"] == "skipped"
    for name in _FP8_ROWS:
        if "megatron" in name and "megatron" not in backends.names():
            continue
        row = rows[name]
        assert row["status"] == "ok", (name, row)
        assert row["first_loss"] == pytest.approx(math.log(512), abs=0.1)
        assert row["mfu"] is None
    assert rows["twinkle_transformers_fp8"]["x_bf16"] > 0
    assert "x_bf16" not in rows["twinkle_transformers_bf16"]


def test_fp8_parity_reports_curves_and_the_difference_from_bf16():
    """Two steps of the built-in data: both rows report their curves and the fp8 row its
    difference from bf16, within 1% of the loss (the tolerance of the backends' fp8 tests)."""
    rows = ["twinkle_transformers_bf16", "twinkle_transformers_fp8"]
    args = ["--workload", "fp8_parity", "--shape", "tiny", "--device", "cpu", "--json", ""]
    result = one_gpu.main([*args, "--parity-steps", "2", "--parity-samples", "4", "--rows", *rows])
    bf16, fp8 = (result["rows"][name] for name in rows)
    assert bf16["status"] == fp8["status"] == "ok"
    assert len(bf16["losses"]) == len(fp8["losses"]) == 2
    assert abs(fp8["loss_diff_vs_bf16"]) <= 1e-2 * bf16["final_loss"]
    assert fp8["max_loss_diff"] >= abs(fp8["loss_diff_vs_bf16"])
