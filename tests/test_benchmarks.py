"""The benchmarks keep running on CPU (their timings are read by people, never asserted)."""

import json

from benchmarks import core_overhead


def test_core_overhead_runs_and_reports_both_loops(tmp_path):
    out = tmp_path / "r.json"
    args = ["--steps", "2", "--warmup", "1", "--hidden", "32", "--layers", "1", "--json", str(out)]
    result = core_overhead.main(args)
    assert set(result["rows"]) == {"torch loop", "twinkle_fn"}
    assert result["rows"]["torch loop"]["ratio_vs_torch_loop"] == 1.0
    assert json.loads(out.read_text())["tokens_per_step"] == result["tokens_per_step"]
