"""`benchmarks.packing` keeps running on CPU (GPU-only rows skipped); timings are never asserted."""

import json
import math

import pytest
import torch

from benchmarks import packing
from benchmarks.flops import flops_per_token
from benchmarks.shapes import qwen25_config
from twinkle_fn import backends

_TINY = ["--shape", "tiny", "--tokens", "64", "--max-len", "32", "--steps", "2", "--warmup", "1"]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("packing") / "r.json"
    return packing.main([*_TINY, "--device", "cpu", "--json", str(out)]), out


def test_cpu_run_reports_every_row_and_writes_the_same_json(cpu_run):
    result, out = cpu_run
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert set(result["rows"]) == set(packing.ROWS)
    assert sum(result["lengths"]) == result["tokens_per_step"] == 64
    for compiled in (name for name in packing.ROWS if "compiled" in name):
        assert result["rows"][compiled]["status"] == "skipped"


@pytest.mark.parametrize("name", ["hf_loop", "twinkle_fsdp", "twinkle_megatron"])
def test_cpu_rows_train_on_the_packed_row(cpu_run, name):
    """Random init: every row's loss is about ln(vocab) (0.1: init noise)."""
    if name == "twinkle_megatron" and "megatron" not in backends.names():
        pytest.skip("no megatron backend in twinkle_fn.backends")
    row = cpu_run[0]["rows"][name]
    assert row["status"] == "ok", row
    assert row["tokens_per_s"] > 0 and row["mfu"] is None and row["peak_mem_gib"] is None
    assert row["first_loss"] == pytest.approx(math.log(512), abs=0.1)
    expected = row["tokens_per_s"] / cpu_run[0]["rows"]["hf_loop"]["tokens_per_s"]
    assert row["x_hf_loop"] == pytest.approx(expected)


def test_sample_lengths_fill_the_row_within_bounds():
    lengths = packing.sample_lengths(10_000, 512, seed=3)
    assert sum(lengths) == 10_000
    assert all(64 <= n <= 512 for n in lengths[:-1]) and 1 <= lengths[-1] <= 512
    assert lengths == packing.sample_lengths(10_000, 512, seed=3)
    with pytest.raises(ValueError, match="positive"):
        packing.sample_lengths(0, 512)


def test_equal_lengths_give_throughputs_flops():
    config = qwen25_config("qwen2.5-0.5b")
    assert packing.flops_per_token(config, [2048] * 8) == flops_per_token(config, 2048)


def test_packed_batch_marks_each_samples_last_token_unsupervised():
    batch = packing.packed_batch([3, 5, 2], vocab_size=50)
    assert batch["cu_seqlens"].tolist() == [0, 3, 8, 10]
    ends = torch.tensor([2, 7, 9])
    assert bool((batch["labels"][0, ends] == -100).all())
    assert torch.equal(batch["labels"][0, :2], batch["input_ids"][0, 1:3])
