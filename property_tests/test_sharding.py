"""Sharding invariants: torch.chunk / DTensor sizes, and local shards rebuild the tensor exactly."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Shard

from twinkle_fn.mesh import COORD_AXES, Mesh
from twinkle_fn.sharding import ShardSpec, local_shard, shard_range, shard_sizes, unshard_local

SETTINGS = settings(max_examples=80, deadline=None)


@SETTINGS
@given(st.integers(0, 300), st.integers(1, 17))
def test_shard_sizes_match_torch_chunk_and_dtensor(n, parts):
    chunks = [c.shape[0] for c in torch.chunk(torch.empty(n), parts)] if n else []
    # torch.chunk drops trailing empty chunks; DTensor's Shard keeps them as empty shards.
    assert shard_sizes(n, parts) == chunks + [0] * (parts - len(chunks))
    for i in range(parts):
        size, offset = Shard.local_shard_size_and_offset(n, parts, i)
        assert shard_range(n, parts, i) == (offset, offset + size)


@st.composite
def mesh_and_axis(draw: st.DrawFn) -> tuple[Mesh, str]:
    tp, fsdp, dp, pp, cp = (draw(st.integers(1, 3)) for _ in range(5))
    stage = tp * cp * fsdp * dp
    ep = draw(st.sampled_from([d for d in range(1, stage + 1) if stage % d == 0]))
    etp = draw(st.sampled_from([d for d in range(1, stage // ep + 1) if (stage // ep) % d == 0]))
    mesh = Mesh(dp=dp, fsdp=fsdp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
    return mesh, draw(st.sampled_from(COORD_AXES))


@SETTINGS
@given(mesh_and_axis(), st.lists(st.integers(0, 9), min_size=1, max_size=4), st.data())
def test_local_shards_over_all_ranks_rebuild_tensor(mesh_axis, shape, data):
    mesh, axis = mesh_axis
    dim = data.draw(st.integers(-len(shape), len(shape) - 1), label="dim")
    spec = ShardSpec(dim, axis)
    tensor = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    parts = mesh.sizes[axis]
    by_index: dict[int, torch.Tensor] = {}
    for r in range(mesh.world_size):
        coords = {**mesh.coords(r), **mesh.expert_coords(r)}
        shard = local_shard(tensor, spec, coords, mesh)
        # Ranks at the same coordinate of the axis hold the same part.
        assert torch.equal(by_index.setdefault(coords[axis], shard), shard)
    assert sorted(by_index) == list(range(parts))
    shards = [by_index[i] for i in range(parts)]
    assert [s.shape[dim] for s in shards] == shard_sizes(shape[dim], parts)
    assert torch.equal(unshard_local(shards, spec), tensor)


@SETTINGS
@given(st.lists(st.integers(0, 9), min_size=1, max_size=4), st.integers(1, 9), st.data())
def test_local_shard_matches_torch_chunk(shape, parts, data):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1), label="dim")
    mesh = Mesh(tp=parts)
    tensor = torch.randn(shape, dtype=torch.float64)
    chunks = list(torch.chunk(tensor, parts, dim=dim)) if tensor.shape[dim] else []
    for i in range(parts):
        shard = local_shard(tensor, ShardSpec(dim, "tp"), {"tp": i}, mesh)
        if i < len(chunks):
            assert torch.equal(shard, chunks[i])
        else:
            assert shard.shape[dim] == 0
