"""`benchmarks.export` keeps running on CPU; timings are never asserted."""

import json

import pytest

from benchmarks import export


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "r.json"
    argv = ["--shape", "tiny", "--device", "cpu", "--bucket-mb", "1", "--repeats", "1"]
    return export.main([*argv, "--json", str(out)]), out


def test_every_row_moves_the_trainers_weights_into_the_consumer(cpu_run):
    result, out = cpu_run
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert set(result["rows"]) == set(export.ROWS)
    for name, row in result["rows"].items():
        # the consumer was zeroed before each row: equal weights mean every tensor arrived
        assert row["max_abs_diff"] == 0.0, name
        assert row["gb_per_s"] > 0 and row["extra_peak_gib"] is None


def test_unknown_shape_is_named():
    with pytest.raises(ValueError, match="unknown shape 'qwen9'"):
        export.config_of("qwen9")
