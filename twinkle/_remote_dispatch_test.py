"""Dispatch and collect policies of ray mode, as pure functions (no Ray, no processes).

Expected parts are written out from upstream's rules: contiguous divmod splits, the same part
for every tp/pp peer of a data rank, one result per data rank when merging.
"""

import numpy as np
import pytest
import torch

from twinkle import DeviceMesh
from twinkle._remote_dispatch import collect_results, dispatch_args
from twinkle.data_format import ModelOutput

DP2_TP2 = DeviceMesh.from_sizes(dp_size=2, tp_size=2)  # ranks 0,1: dp 0; ranks 2,3: dp 1


def test_slice_dp_gives_every_peer_of_a_data_rank_the_same_part():
    rows = list(range(5))
    batch = {"input_ids": torch.arange(10).reshape(5, 2), "name": "b", "ids": np.arange(5)}
    calls = dispatch_args("slice_dp", 4, DP2_TP2, (rows, 7), {"batch": batch, "scale": 2.0})
    assert [DP2_TP2.get_data_rank_from_global_rank(r) for r in range(4)] == [0, 0, 1, 1]
    parts = [[0, 1, 2], [0, 1, 2], [3, 4], [3, 4]]  # divmod: the first data rank gets 3
    for (args, kwargs), part in zip(calls, parts, strict=True):
        assert args == (part, 7) and kwargs["scale"] == 2.0
        assert kwargs["batch"]["name"] == "b"
        assert torch.equal(kwargs["batch"]["input_ids"], torch.arange(10).reshape(5, 2)[part])
        assert kwargs["batch"]["ids"].tolist() == part


def test_slice_dp_keeps_dict_subclasses_and_refuses_what_cannot_be_split():
    (args0, _), (args1, _) = dispatch_args(
        "slice_dp", 2, DeviceMesh.from_sizes(dp_size=2), (ModelOutput(x=[1, 2, 3, 4]),), {}
    )
    assert type(args0[0]) is ModelOutput and args0[0].x == [1, 2] and args1[0].x == [3, 4]
    with pytest.raises(ValueError, match="a batch of 1 cannot be split over 2 data ranks"):
        dispatch_args("slice_dp", 4, DP2_TP2, ([1],), {})
    with pytest.raises(ValueError, match="needs a mesh of 3 ranks"):
        dispatch_args("slice_dp", 3, DP2_TP2, ([1, 2, 3],), {})


def test_slice_splits_lists_by_rank_and_all_repeats_everything():
    calls = dispatch_args("slice", 4, DP2_TP2, (list(range(6)), "keep"), {"t": torch.ones(4)})
    assert [args for args, _ in calls] == [
        ([0, 1], "keep"),
        ([2, 3], "keep"),
        ([4], "keep"),
        ([5], "keep"),
    ]
    assert all(torch.equal(kwargs["t"], torch.ones(4)) for _, kwargs in calls)  # not split
    calls = dispatch_args("all", 3, DeviceMesh.from_sizes(dp_size=3), ([1, 2],), {"k": [3]})
    assert calls == [(([1, 2],), {"k": [3]})] * 3


def test_a_dispatch_function_chooses_each_ranks_arguments():
    def every_other(n, i, args, kwargs, mesh):
        assert mesh is DP2_TP2
        return (args[0][i::n],), kwargs

    calls = dispatch_args(every_other, 4, DP2_TP2, (list(range(8)),), {"k": 1})
    assert [args[0] for args, _ in calls] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match=r"must return \(args, kwargs\)"):
        dispatch_args(lambda n, i, a, k, m: a, 2, DP2_TP2, ([1],), {})
    with pytest.raises(ValueError, match="unknown dispatch 'scatter'"):
        dispatch_args("scatter", 2, DP2_TP2, (), {})


def test_collect_none_first_sum_mean_and_last_pp():
    ranks = [0, 1, 2, 3]
    assert collect_results("none", [1, 2, 3, 4], ranks, DP2_TP2) == [1, 2, 3, 4]
    assert collect_results("none", ["only"], [0], DP2_TP2) == "only"
    assert collect_results("first", [5, 6, 7, 8], ranks, DP2_TP2) == 5
    assert collect_results("sum", [1, 2, 3, 4], ranks, DP2_TP2) == 10
    assert collect_results("mean", [1.0, 2.0, 3.0, 4.0], ranks, DP2_TP2) == 2.5
    assert collect_results("mean", [None, None, None, None], ranks, DP2_TP2) is None
    mean = collect_results("mean", [torch.tensor(1.0), torch.tensor(3.0)], [0, 1], DP2_TP2)
    assert torch.equal(mean, torch.tensor(2.0))
    assert collect_results("sum", [(1, 2.0), (2, 4.0)], [0, 1], DP2_TP2) == (3, 6.0)
    pp2 = DeviceMesh.from_sizes(dp_size=2, pp_size=2)  # ranks 2,3 are the last stage
    assert pp2.get_pp_last_ranks() == [2, 3]
    assert collect_results("last_pp", ["a", "b", "c", "d"], ranks, pp2) == ["c", "d"]
    assert collect_results("last_pp_first", ["a", "b", "c", "d"], ranks, pp2) == "c"
    assert collect_results(lambda rs: max(rs), [3, 9, 1, 2], ranks, DP2_TP2) == 9
    with pytest.raises(ValueError, match="unknown collect 'max'"):
        collect_results("max", [1], [0], DP2_TP2)


def test_flatten_keeps_one_result_per_data_rank():
    # tp peers (0, 1) and (2, 3) return the same rows: each data rank's rows come back once.
    results = [[0, 1], [0, 1], [2], [2]]
    assert collect_results("flatten", results, [0, 1, 2, 3], DP2_TP2) == [0, 1, 2]
    tensors = [torch.ones(2, 3), torch.ones(2, 3), torch.zeros(1, 1), torch.zeros(1, 1)]
    flat = collect_results("flatten", tensors, [0, 1, 2, 3], DP2_TP2)
    assert flat.shape == (3, 3) and flat[:2].eq(1).all() and flat[2].eq(0).all()
    # A subset of ranks (execute='first'-like) is concatenated as it is.
    assert collect_results("flatten", [[1], [2]], [0, 3], DP2_TP2) == [1, 2]


def test_dict_results_merge_like_upstreams_collect_tensor_dict():
    mesh = DeviceMesh.from_sizes(dp_size=2)
    outs = [
        ModelOutput(loss=1.0, num_tokens=3, logps=torch.full((2, 3), -1.0), ids=[1, 2], x=None),
        ModelOutput(loss=2.0, num_tokens=5, logps=torch.full((1, 5), -2.0), ids=[3], x=None),
    ]
    merged = collect_results("mean", outs, [0, 1], mesh)
    assert type(merged) is ModelOutput
    assert merged.loss == 1.5 and merged.num_tokens == 8 and merged.ids == [1, 2, 3]
    assert merged.x is None
    expected = torch.tensor([[-1.0, -1, -1, 0, 0], [-1, -1, -1, 0, 0], [-2, -2, -2, -2, -2]])
    assert torch.equal(merged.logps, expected)  # padded with 0, as ignored labels locally
    summed = collect_results("sum", outs, [0, 1], mesh)
    assert summed.loss == 3.0 and summed.num_tokens == 8
    assert collect_results("flatten", outs, [0, 1], mesh).loss == 1.5
    nested = collect_results("mean", [{"m": {"a": 1.0}}, {"m": {"a": 3.0}}], [0, 1], mesh)
    assert nested == {"m": {"a": 2.0}}
