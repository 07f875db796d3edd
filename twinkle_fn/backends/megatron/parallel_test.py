import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from twinkle_fn.backends.megatron import cpu_compat, parallel
from twinkle_fn.mesh import Mesh
from twinkle_fn.testing_dist import spawn

MESHES = {
    2: [Mesh(tp=2), Mesh(pp=2), Mesh(cp=2), Mesh(fsdp=2), Mesh(dp=2, ep=2)],
    4: [
        Mesh(tp=2, pp=2),
        Mesh(tp=2, dp=2, ep=2),
        Mesh(cp=2, fsdp=2, ep=2, etp=2),
        Mesh(fsdp=2, dp=2, ep=4),
        Mesh(pp=2, dp=2, ep=2),
    ],
}


def _megatron_groups() -> dict[str, list[int]]:
    """This rank's megatron-core groups, under our `Mesh` names."""
    groups = {
        "tp": parallel_state.get_tensor_model_parallel_group(),
        "pp": parallel_state.get_pipeline_model_parallel_group(),
        "cp": parallel_state.get_context_parallel_group(),
        "dp_total": parallel_state.get_data_parallel_group(),
        "mp": parallel_state.get_model_parallel_group(),
        "ep": parallel_state.get_expert_model_parallel_group(),
        "etp": parallel_state.get_expert_tensor_parallel_group(),
        "edp": parallel_state.get_expert_data_parallel_group(),
    }
    return {name: dist.get_process_group_ranks(group) for name, group in groups.items()}


def _rng_states() -> dict[str, torch.Tensor]:
    tracker = tensor_parallel.get_cuda_rng_tracker()
    return {"cpu": torch.get_rng_state(), **tracker.get_states()}


def _initialize_each(world: int) -> list[dict]:
    out = []
    for mesh in MESHES[world]:
        parallel.initialize(mesh, seed=7)
        out.append(
            {
                "groups": _megatron_groups(),
                "data_rank": parallel_state.get_data_parallel_rank(),
                "rng": _rng_states(),
                "compat": cpu_compat.is_enabled(),
            }
        )
        parallel.destroy()
        out[-1]["compat_after"] = cpu_compat.is_enabled()
    if world == 2:
        out.append(_errors())
    return out


def _errors() -> dict[str, str]:
    errors = {}
    try:
        parallel.initialize(Mesh(tp=4))
    except ValueError as e:
        errors["world"] = str(e)
    parallel.initialize(Mesh(dp=2))
    try:
        parallel.initialize(Mesh(dp=2))
    except RuntimeError as e:
        errors["twice"] = str(e)
    parallel.destroy()
    return errors


@pytest.mark.parametrize("world", sorted(MESHES))
def test_megatron_groups_are_the_mesh_groups(world):
    """On real gloo ranks: every megatron group equals `Mesh.group_ranks`' group of that rank."""
    per_rank = spawn(_initialize_each, world, world)
    for i, mesh in enumerate(MESHES[world]):
        for rank, results in enumerate(per_rank):
            got = results[i]
            want = mesh.groups_of(rank)
            for name, ranks in got["groups"].items():
                assert ranks == want[name], (mesh, rank, name)
            assert got["data_rank"] == mesh.data_rank(rank)
            assert got["compat"] and not got["compat_after"]
        _check_seeds(mesh, [results[i]["rng"] for results in per_rank])
    if world == 2:
        errors = per_rank[0][-1]
        assert "the world has 2" in errors["world"]
        assert "call twinkle_fn.backends.megatron.parallel.destroy()" in errors["twice"]


def _check_seeds(mesh: Mesh, states: list[dict[str, torch.Tensor]]) -> None:
    """The CPU stream is seed 7 everywhere; the tensor-parallel stream differs across tp only."""
    want_cpu = torch.Generator().manual_seed(7).get_state()
    assert all(torch.equal(s["cpu"], want_cpu) for s in states)
    for rank, state in enumerate(states):
        for other, other_state in enumerate(states):
            same_tp = mesh.coords(rank)["tp"] == mesh.coords(other)["tp"]
            equal = torch.equal(state["model-parallel-rng"], other_state["model-parallel-rng"])
            assert equal == same_tp, (mesh, rank, other)


def test_vpp_is_refused_before_anything_is_initialized():
    before = parallel_state.model_parallel_is_initialized(), cpu_compat.is_enabled()
    with pytest.raises(ValueError, match="virtual pipeline parallelism is not supported yet"):
        parallel.initialize(Mesh(), vpp=2)
    with pytest.raises(ValueError, match="vpp must be None or a positive int"):
        parallel.initialize(Mesh(), vpp=0)
    with pytest.raises(ValueError, match="ulysses=2: Ulysses sequence parallelism belongs to"):
        parallel.initialize(Mesh(ulysses=2))
    assert (parallel_state.model_parallel_is_initialized(), cpu_compat.is_enabled()) == before


def test_initialize_needs_torch_distributed(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    enabled = cpu_compat.is_enabled()
    with pytest.raises(RuntimeError, match="init_process_group"):
        parallel.initialize(Mesh())
    assert cpu_compat.is_enabled() == enabled
