"""`twinkle.DeviceMesh`, `initialize`, `remote_class` and `remote_function` (local mode).

Rank queries are checked for every rank of a mesh (``RANK`` set per rank, as a launcher does)
against the core's `twinkle_fn.Mesh` and against upstream's formulas written out here.
"""

import inspect

import numpy as np
import pytest

import twinkle
from twinkle import DeviceMesh, initialize, remote_class, remote_function
from twinkle.infra import RemoteFunctionSpec, settings
from twinkle.model import TransformersModel
from twinkle_fn import Mesh

SIZES = {"dp_size": 2, "fsdp_size": 2, "tp_size": 2, "pp_size": 2}


def _at_rank(monkeypatch, rank):
    monkeypatch.setenv("RANK", str(rank))


def test_from_sizes_maps_onto_the_core_mesh():
    mesh = DeviceMesh.from_sizes(**SIZES, cp_size=1, ep_size=2, sequence_parallel=True)
    assert mesh.core_mesh == Mesh(dp=2, fsdp=2, tp=2, pp=2, ep=2, sequence_parallel=True)
    assert mesh.world_size == 16 and mesh.data_world_size == 4
    assert (mesh.dp_world_size, mesh.fsdp_world_size, mesh.tp_world_size) == (2, 2, 2)
    assert (mesh.pp_world_size, mesh.cp_world_size, mesh.ep_world_size) == (2, 1, 2)
    assert mesh.etp_world_size == 1 and mesh.sequence_parallel
    assert mesh.mesh_dim_names == ("fsdp", "pp", "dp", "cp", "tp")  # upstream's order, set dims
    assert mesh.order == "tp-cp-ep-dp-pp"
    assert DeviceMesh.from_sizes().world_size == 1
    assert DeviceMesh.from_sizes(world_size=8, dp_size=None, tp_size=2).core_mesh == Mesh(
        dp=4, tp=2
    )
    assert DeviceMesh.from_sizes(world_size=4, dp_size=2, fsdp_size=2).world_size == 4


def test_rank_queries_of_every_rank(monkeypatch):
    mesh = DeviceMesh.from_sizes(**SIZES)
    core = mesh.core_mesh
    seen_data_ranks = []
    for rank in range(mesh.world_size):
        _at_rank(monkeypatch, rank)
        coords = core.coords(rank)
        assert mesh.dp_rank == coords["dp"] and mesh.fsdp_rank == coords["fsdp"]
        assert mesh.tp_rank == coords["tp"] and mesh.pp_rank == coords["pp"]
        assert mesh.cp_rank is None and mesh.ep_rank == 0  # cp_size unset: no cp axis
        # upstream: data_rank = dp_rank * fsdp_world_size + fsdp_rank
        assert mesh.data_rank == mesh.dp_rank * mesh.fsdp_world_size + mesh.fsdp_rank
        assert mesh.get_data_rank_from_global_rank(rank) == mesh.data_rank
        assert mesh.is_pp_first_rank() == (mesh.pp_rank == 0)
        assert mesh.is_pp_last_rank() == (mesh.pp_rank == 1)
        assert mesh.is_tp_last_rank() == (mesh.tp_rank == 1)
        tp_group = mesh.get_tp_ranks()
        assert rank in tp_group and len(tp_group) == 2
        assert {core.coords(r)["tp"] for r in tp_group} == {0, 1}
        seen_data_ranks.append(mesh.data_rank)
    assert sorted(set(seen_data_ranks)) == [0, 1, 2, 3]
    # each data rank is shared by its tp x pp peers
    assert all(seen_data_ranks.count(d) == 4 for d in range(4))


def test_get_slice_takes_a_data_rank_as_upstream(monkeypatch):
    mesh = DeviceMesh.from_sizes(dp_size=2, fsdp_size=2, tp_size=2)
    for total in (4, 10, 13):
        # upstream's divmod split, written out
        k, m = divmod(total, 4)
        expected = [slice(d * k + min(d, m), (d + 1) * k + min(d + 1, m)) for d in range(4)]
        assert [mesh.get_slice(total, d) for d in range(4)] == expected
        covered = [i for d in range(4) for i in range(total)[mesh.get_slice(total, d)]]
        assert covered == list(range(total))
        for rank in range(mesh.world_size):  # default: this process's data rank
            _at_rank(monkeypatch, rank)
            assert mesh.get_slice(total) == expected[mesh.data_rank]
    assert DeviceMesh.from_sizes(tp_size=2).get_slice(3) == slice(0, 3)
    with pytest.raises(ValueError, match="cannot be split over 4 data ranks"):
        mesh.get_slice(3, 0)
    with pytest.raises(ValueError, match="data rank 4 is out of range"):
        mesh.get_slice(8, 4)


def test_stage_and_collect_ranks():
    mesh = DeviceMesh.from_sizes(**SIZES)
    stages = [mesh.get_pp_stage_ranks(s) for s in range(2)]
    assert sorted(stages[0] + stages[1]) == list(range(16))
    assert mesh.get_pp_first_ranks() == stages[0] and mesh.get_pp_last_ranks() == stages[1]
    collect = mesh.get_collect_ranks()
    assert [mesh.get_data_rank_from_global_rank(r) for r in collect] == [0, 1, 2, 3]
    assert all(r in stages[1] for r in collect)
    assert len(mesh.get_tp_last_ranks()) == 8
    with pytest.raises(ValueError, match="stage 2 is out of range"):
        mesh.get_pp_stage_ranks(2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"vpp_size": 2, "pp_size": 2},
            "vpp_size=2: virtual pipeline parallelism is not supported",
        ),
        ({"world_size": 8, "dp_size": 2, "tp_size": 2}, "world_size=8 but the sizes give"),
        ({"world_size": 6, "dp_size": None, "tp_size": 4}, "cannot hold"),
        ({"tp_size": 0}, "tp_size must be a positive int"),
        ({"sequence_parallel": True}, "needs tp > 1"),
    ],
)
def test_bad_meshes_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DeviceMesh.from_sizes(**kwargs)


def test_unit_vpp_and_ulysses_are_accepted():
    assert DeviceMesh.from_sizes(vpp_size=1, ulysses_size=1).world_size == 1


def test_ulysses_size_is_the_core_ulysses_axis():
    mesh = DeviceMesh.from_sizes(ulysses_size=2)
    assert mesh.core_mesh == Mesh(ulysses=2) and mesh.ulysses_size == 2
    assert mesh.mesh_dim_names == ("dp", "ulysses") and mesh.mesh.tolist() == [[0, 1]]
    assert mesh.world_size == 2 and mesh.data_world_size == 1  # its ranks share the data
    assert DeviceMesh(ulysses_size=2).core_mesh == Mesh(ulysses=2)
    mixed = DeviceMesh.from_sizes(world_size=8, dp_size=None, ulysses_size=2, tp_size=2)
    assert mixed.core_mesh == Mesh(dp=2, tp=2, ulysses=2)
    # the rank array follows the core's order: tp fastest, then ulysses, then dp
    assert mixed.mesh_dim_names == ("dp", "ulysses", "tp")
    assert mixed.mesh.tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    with pytest.raises(ValueError, match="ulysses_size=4 disagrees with the mesh's 2"):
        DeviceMesh(Mesh(ulysses=2), ulysses_size=4)
    with pytest.raises(ValueError, match="ulysses_size=2 with a rank array"):
        DeviceMesh(mesh=np.arange(2), mesh_dim_names=("dp",), ulysses_size=2)


def test_a_rank_outside_the_mesh_is_named(monkeypatch):
    _at_rank(monkeypatch, 5)
    with pytest.raises(ValueError, match="this process is rank 5 but the mesh has 4 ranks"):
        _ = DeviceMesh.from_sizes(dp_size=4).data_rank


def test_initialize_local_mode_checks_the_world():
    before = settings()
    try:
        initialize(mode="local", seed=7)
        assert settings().device_mesh.world_size == 1 and settings().seed == 7
        with pytest.raises(ValueError, match=r"has 2 ranks but torch\.distributed's world has 1"):
            initialize(global_device_mesh=DeviceMesh.from_sizes(fsdp_size=2))
        with pytest.raises(ValueError, match=r"needs the ray package|needs groups="):
            initialize(mode="ray")  # ray mode itself: twinkle/_ray_engine_test.py
        with pytest.raises(ValueError, match="mode must be one of local, ray"):
            initialize(mode="slurm")
    finally:
        twinkle.infra._SETTINGS[0] = before


def test_remote_class_injects_the_global_mesh_and_drops_ray_arguments():
    @remote_class(execute="all")
    class Worker:
        def __init__(self, x, device_mesh: DeviceMesh | None = None):
            self.x, self.device_mesh = x, device_mesh

    before = settings()
    try:
        mesh = DeviceMesh.from_sizes()
        initialize(global_device_mesh=mesh)
        w = Worker(1, remote_group="actor", instance_id="i0")
        assert w.x == 1 and w.device_mesh is mesh and w._remote_group == "actor"
        explicit = DeviceMesh.from_sizes(dp_size=1, tp_size=None)
        assert Worker(2, explicit).device_mesh is explicit
    finally:
        twinkle.infra._SETTINGS[0] = before
    assert list(inspect.signature(Worker.__init__).parameters) == ["self", "x", "device_mesh"]
    params = inspect.signature(TransformersModel.__init__).parameters
    assert list(params)[1:5] == ["model_cls", "model_id", "config", "device_mesh"]


def test_remote_function_records_its_policy_and_calls_directly():
    def method(self, inputs):
        return inputs

    wrapped = remote_function(dispatch="slice_dp", collect="mean")(method)
    assert wrapped is method and wrapped(None, 3) == 3
    assert wrapped.__twinkle_remote__ == RemoteFunctionSpec(
        "slice_dp", "all", "mean", False, None, None
    )
    assert TransformersModel.forward_backward.__twinkle_remote__.dispatch == "slice_dp"
    with pytest.raises(ValueError, match="dispatch must be one of"):
        remote_function(dispatch="scatter")
    with pytest.raises(ValueError, match="collect must be one of"):
        remote_function(collect="max")
    with pytest.raises(ValueError, match="execute must be one of"):
        remote_class(execute="some")
