"""benchmarks/multi_gpu.py on CPU: its worlds launch over gloo and its parity check can fail.

The GPU figures come from the device (benchmarks/RESULTS.md); here the tiny models run two
parity meshes and two speed rows so the script keeps working, and the overlap arithmetic is
checked in test_profile_summary.py.
"""

import pytest

from benchmarks import multi_gpu, multi_gpu_meshes


def test_parity_table_flags_a_diverging_mesh():
    ref = {"ref/fsdp/dense": {"status": "ok", "losses": [5.0, 4.0]}}
    got = {
        "fsdp/dp2": {"status": "ok", "losses": [5.0, 4.001]},
        "fsdp/tp2": {"status": "ok", "losses": [5.0, 4.5]},
    }
    table = multi_gpu._parity_table(["fsdp/dp2", "fsdp/tp2"], ref, got, rtol=1e-2)
    assert table["fsdp/dp2"]["pass"] and not table["fsdp/tp2"]["pass"]
    assert table["fsdp/tp2"]["max_rel"] == pytest.approx(0.125)


def test_two_process_run_on_cpu(tmp_path):
    result = multi_gpu.main(
        [
            "--tiny", "--steps", "2", "--meshes", "fsdp/dp2", "megatron/tp2",
            "--speed", "fsdp/1gpu", "fsdp/dp2", "--shape", "tiny", "--seq", "64",
            "--micro-batch", "2", "--timed", "2", "--host-ops", "4",
            "--json", str(tmp_path / "out.json"),
        ]
    )  # fmt: skip
    for name, row in result["parity"].items():
        assert row["status"] == "ok", (name, row)
        assert len(row["losses"]) == 2 and row["pass"], (name, row)
        # the tiny models agree far inside the bf16 bound the GPU run checks
        assert row["max_rel"] < 1e-3, (name, row)
    for name, row in result["speed"].items():
        assert row["status"] == "ok" and row["tokens_per_s"] > 0, (name, row)
        # on a CPU the step's work is the host's: its call returns when the step is done
        assert 0 < row["host_ms"] <= row["step_ms"] * 1.5, (name, row)
        assert len(row["host_ops"]) == 4 and row["host_ops"][0]["calls"] > 0, (name, row)
        phases = row["phases_s"]
        assert phases.keys() == {"build", "steps", "profile"} and min(phases.values()) >= 0
    assert result["speed"]["fsdp/dp2"]["global_batch"] == 4
    assert result["speed"]["fsdp/dp2"]["scaling"] > 0
    assert (tmp_path / "out.json").exists()


@pytest.mark.slow
def test_four_rank_meshes_on_cpu():
    """Issue 8's meshes on 4 gloo ranks (fsdp4, dp2 x fsdp2; megatron tp2 x pp2, dp2 x tp2, ep4
    and ep2 x tp2 on an 8-expert MoE) agree with one process, step for step."""
    result = multi_gpu.main(["--nproc", "4", "--tiny", "--steps", "2", "--speed"])
    assert set(result["parity"]) == {
        m for m in multi_gpu_meshes.MESHES if multi_gpu_meshes.mesh_world(m) == 4
    }
    for name, row in result["parity"].items():
        assert row["status"] == "ok", (name, row)
        assert row["pass"] and row["max_rel"] < 1e-3, (name, row)


def test_the_param_gather_row_runs_only_when_named():
    rows = multi_gpu_meshes.default_speed_rows(2)
    assert "megatron/dp2" in rows and "megatron/dp2-gather" not in rows
    assert multi_gpu_meshes.SPEED_ROWS["megatron/dp2-gather"][2]["overlap_param_gather"] is True


def test_one_gpu_rows_share_a_wave_only_across_gpus():
    rows = ["fsdp/1gpu", "fsdp/dp2", "megatron/1gpu", "megatron/dp2"]
    assert multi_gpu.speed_waves(rows, gpus=2) == [
        ["fsdp/1gpu", "megatron/1gpu"],
        ["fsdp/dp2"],
        ["megatron/dp2"],
    ]
    # without GPUs (or with one) the one-process rows run one at a time, still before the rest
    assert multi_gpu.speed_waves(rows, gpus=0) == [
        ["fsdp/1gpu"],
        ["megatron/1gpu"],
        ["fsdp/dp2"],
        ["megatron/dp2"],
    ]


def test_a_variant_row_scales_against_its_own_one_gpu_row():
    assert multi_gpu_meshes.one_gpu_row("fsdp/fsdp2-compiled") == "fsdp/1gpu-compiled"
    assert multi_gpu_meshes.one_gpu_row("fsdp/fsdp2") == "fsdp/1gpu"
    # no one-GPU row of that variant: the backend's plain one
    assert multi_gpu_meshes.one_gpu_row("megatron/dp2-gather") == "megatron/1gpu"
    assert multi_gpu_meshes.SPEED_ROWS["fsdp/dp2-compiled"][2] == {"compile_layers": True}
    assert not {"fsdp/1gpu-compiled", "fsdp/dp2-compiled"} & set(
        multi_gpu_meshes.default_speed_rows(2)
    )
