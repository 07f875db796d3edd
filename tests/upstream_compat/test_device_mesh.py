"""`DeviceMesh(mesh=<rank array>, mesh_dim_names=...)` as upstream's tests and dataloader build
it: the array becomes the core's `twinkle_fn.Mesh` when it lays ranks out in the core's
(Megatron) order, and every rank query then answers as upstream's numpy lookup does."""

from unittest.mock import patch

import numpy as np
import pytest

from twinkle import DeviceMesh, Platform
from twinkle.dataloader import DataLoader
from twinkle_fn import Mesh


def test_a_one_axis_array_is_dp():
    mesh = DeviceMesh(device_type="cpu", mesh=np.array([0, 1]), mesh_dim_names=("dp",))
    assert mesh.core_mesh == Mesh(dp=2) and mesh == DeviceMesh.from_sizes(
        dp_size=2, device_type="cpu"
    )
    assert mesh.mesh_dim_names == ("dp",) and mesh.data_world_size == 2
    assert mesh.get_dim_size("dp") == 2 and mesh.world_size == 2
    assert mesh.get_slice(5, rank=0) == slice(0, 3) and mesh.get_slice(5, rank=1) == slice(3, 5)


def test_every_rank_of_a_custom_array_answers_as_its_coordinates(monkeypatch):
    ranks = np.arange(16).reshape(2, 2, 4)  # upstream's test_custom_mesh
    mesh = DeviceMesh(mesh=ranks, mesh_dim_names=("pp", "dp", "tp"))
    assert mesh.core_mesh == Mesh(pp=2, dp=2, tp=4)
    assert (mesh.pp_world_size, mesh.dp_world_size, mesh.tp_world_size) == (2, 2, 4)
    assert mesh.mesh_dim_names == ("pp", "dp", "tp") and mesh.data_world_size == 2
    for index in np.ndindex(ranks.shape):
        monkeypatch.setenv("RANK", str(int(ranks[index])))
        assert (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank) == index
        assert mesh.data_rank == index[1] and mesh.fsdp_rank is None  # no fsdp axis
        assert mesh.get_tp_ranks() == sorted(ranks[index[0], index[1], :].tolist())
    assert mesh.get_pp_last_ranks() == sorted(ranks[1].ravel().tolist())


def test_nested_lists_and_expert_sizes_are_accepted():
    mesh = DeviceMesh(
        mesh=[[0, 1], [2, 3]], mesh_dim_names=("fsdp", "tp"), ep_size=2, sequence_parallel=True
    )
    assert mesh.core_mesh == Mesh(fsdp=2, tp=2, ep=2, sequence_parallel=True)
    assert mesh.ep_size == 2 and mesh.etp_size == 1 and mesh.ep_fsdp_size == 2
    assert DeviceMesh.from_sizes(dp_size=4, ep_size=2, ep_fsdp_size=2).ep_fsdp_size == 2


def test_the_dataloader_slices_by_an_array_mesh(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    mesh = DeviceMesh(mesh=np.array([0, 1]), mesh_dim_names=("dp",))
    rows = [{"x": i} for i in range(8)]
    batches = list(DataLoader(dataset=rows, batch_size=4, device_mesh=mesh))
    assert [[r["x"] for r in b] for b in batches] == [[2, 3], [6, 7]]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (  # upstream's from_sizes layout (fsdp outermost) with dp > 1: not the core's order
            {"mesh": np.arange(4).reshape(2, 2), "mesh_dim_names": ("fsdp", "dp")},
            r"puts rank 1 at \{'fsdp': 0, 'dp': 1\}.*np\.arange\(4\)\.reshape\(2, 2\) with "
            r"mesh_dim_names=\('dp', 'fsdp'\)",
        ),
        (
            {"mesh": np.array([[0, 2], [1, 3]]), "mesh_dim_names": ("dp", "tp")},
            "lays ranks out in Megatron order",
        ),
        ({"mesh": np.array([0, 1])}, r"needs mesh_dim_names.*\('dp',\)"),
        ({"mesh": np.array([0, 1]), "mesh_dim_names": ("ep",)}, "pass ep_size= instead"),
        ({"mesh": np.array([0, 1]), "mesh_dim_names": ("dp", "dp")}, "once"),
        ({"mesh": np.arange(4).reshape(2, 2), "mesh_dim_names": ("dp",)}, "names 1 axes"),
        ({"mesh": np.array([1, 2]), "mesh_dim_names": ("dp",)}, r"ranks 0\.\.1 once each"),
        ({"mesh": Mesh(dp=2), "mesh_dim_names": ("dp",)}, "leave mesh_dim_names unset"),
        ({"mesh": Mesh(dp=2), "ep_size": 2}, r"ep_size=2 disagrees with the mesh's 1"),
        ({"mesh": Mesh(dp=4, ep=2), "ep_fsdp_size": 4}, r"ep_fsdp_size=4 .* = 2 ranks"),
    ],
)
def test_layouts_the_core_cannot_express_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DeviceMesh(**kwargs)


def test_mesh_is_the_rank_array_and_ranks_follow_platform_get_rank():
    """Upstream: ``mesh`` is the array of global ranks over ``mesh_dim_names``; each rank query
    looks this process's `Platform.get_rank` up in it; an axis the names leave out, or a rank
    outside the array, answers None."""
    mesh = DeviceMesh.from_sizes(dp_size=2, fsdp_size=2, tp_size=2)
    assert mesh.mesh_dim_names == ("fsdp", "dp", "tp") and mesh.mesh.shape == (2, 2, 2)
    for index in np.ndindex(mesh.mesh.shape):
        rank = int(mesh.mesh[index])
        with patch.object(Platform, "get_rank", return_value=rank):
            assert (mesh.fsdp_rank, mesh.dp_rank, mesh.tp_rank) == index
            assert mesh.pp_rank is None and mesh.cp_rank is None
            assert mesh.data_rank == index[1] * 2 + index[0]  # dp_rank * fsdp_size + fsdp_rank
    with patch.object(Platform, "get_rank", return_value=8):
        assert (mesh.dp_rank, mesh.fsdp_rank, mesh.tp_rank) == (None, None, None)
    assert DeviceMesh.from_sizes(tp_size=1).tp_rank == 0  # a size given, even 1, names the axis
