"""benchmarks/profile_summary.py's arithmetic on hand-made kernel spans (the GPU traces it reads
come from the device)."""

import gzip
import json

import pytest

from benchmarks import profile_summary as ps


def test_union_merges_touching_and_nested_spans():
    assert ps.union([(5, 6), (0, 2), (1, 3), (3, 4), (5.5, 5.8)]) == [(0, 4), (5, 6)]


@pytest.mark.parametrize(
    ("xs", "ys", "expected"),
    [
        ([(0, 10)], [(2, 3), (5, 7)], 3),
        ([(0, 1), (4, 6)], [(0.5, 5)], 1.5),
        ([(0, 1)], [(1, 2)], 0),
        ([], [(0, 1)], 0),
    ],
)
def test_intersection_of_span_lists(xs, ys, expected):
    assert ps.intersection(xs, ys) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "nccl"),
        ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>", "attention"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>", "optimizer"),
        ("_adamw_kernel", "optimizer"),  # twinkle_fn.optim's own Triton AdamW
        ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", "triton"),
        ("void at::native::vectorized_elementwise_kernel<4, ...>", "elementwise"),
        ("some_custom_kernel", "other"),
    ],
)
def test_kernel_kinds(name, kind):
    assert ps.kind_of(name) == kind


def test_summary_of_two_steps():
    # Per step: 6 us of compute, 4 us of NCCL of which 1 us overlaps compute, 2 us idle.
    step = [
        {"name": "gemm_a", "ts": 0, "dur": 4},
        {"name": "ncclAllReduce", "ts": 3, "dur": 4},
        {"name": "triton_b", "ts": 7, "dur": 2},
        # idle 9..11
    ]
    kernels = step + [dict(e, ts=e["ts"] + 11) for e in step]
    s = ps.summarise(kernels, n=2)
    assert s["wall_ms"] == pytest.approx(20e-3 / 2)  # 0..20 us over two steps
    assert s["busy"] == pytest.approx(18 / 20)
    assert s["comm_ms"] == pytest.approx(4e-3)
    assert s["exposed_comm_ms"] == pytest.approx(3e-3)
    assert s["overlapped"] == pytest.approx(0.25)
    assert s["kernels_ms"] == {
        "gemm": pytest.approx(4e-3),
        "nccl": pytest.approx(4e-3),
        "triton": pytest.approx(2e-3),
    }
    assert s["exposed_by_kernel"] == {"ncclAllReduce": pytest.approx(3e-3)}
    # the idle stretches, longest first: 9..11 between the steps; none inside a step
    assert s["gaps"] == [
        {
            "at_ms": pytest.approx(9e-3),
            "ms": pytest.approx(2e-3),
            "after": "triton_b",
            "before": "gemm_a",
        }
    ]
    assert list(s["top_kernels"]) == ["gemm_a", "ncclAllReduce", "triton_b"]
    assert s["top_kernels"]["triton_b"] == pytest.approx(2e-3)
    text = ps.format_summary(s)
    assert "kernel    0.00 ms: gemm_a" in text
    assert "busy 90%" in text and "exposed: ncclAllReduce 0.00 ms" not in text
    assert "idle 0.00 ms at 0.0 ms: after triton_b, before gemm_a" in text


def test_host_ops_counts_each_operator_per_step():
    import torch

    a = torch.randn(64, 64)

    def step():
        return (a @ a @ a).sum()

    ops = {op["name"]: op for op in ps.host_ops(step, n=2, top=50)}
    assert ops["aten::mm"]["calls"] == 2  # two matmuls a step, averaged over the two steps
    assert ops["aten::sum"]["calls"] == 1
    assert all(op["self_ms"] >= 0 for op in ops.values())


def test_a_kept_trace_summarises_from_the_command_line(tmp_path, capsys):
    events = [
        {"ph": "X", "cat": "kernel", "name": "gemm_a", "ts": 0, "dur": 4},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9},  # host: not counted
        {"ph": "X", "cat": "kernel", "name": "triton_b", "ts": 6, "dur": 2},
    ]
    trace = tmp_path / "row.json.gz"
    trace.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    summary = ps.main([str(trace), "--steps", "1"])
    assert summary["wall_ms"] == pytest.approx(8e-3)
    assert summary["busy"] == pytest.approx(6 / 8)
    assert summary["kernels_ms"] == {"gemm": pytest.approx(4e-3), "triton": pytest.approx(2e-3)}
    assert "ms/step on the GPU, busy 75%" in capsys.readouterr().out
