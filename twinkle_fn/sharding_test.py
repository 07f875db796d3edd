import pytest
import torch

from twinkle_fn.mesh import Mesh
from twinkle_fn.sharding import (
    ShardSpec,
    local_shard,
    shard_range,
    shard_sizes,
    spec_for,
    unshard_local,
    unshard_pieces,
)

MESH = Mesh(dp=2, tp=3, ep=2)


def _chunk_sizes(n: int, parts: int) -> list[int]:
    # torch.chunk drops trailing empty chunks; DTensor's Shard keeps them as empty shards.
    sizes = [c.shape[0] for c in torch.chunk(torch.empty(n), parts)] if n else []
    return sizes + [0] * (parts - len(sizes))


def test_spec_defaults_to_replicated():
    assert ShardSpec().replicated
    s = ShardSpec(0, "tp")
    assert not s.replicated and s.dim == 0 and s.axis == "tp"
    assert ShardSpec(0, "tp") == s and hash(ShardSpec(0, "tp")) == hash(s)


@pytest.mark.parametrize(
    ("n", "parts", "expected"),
    [(8, 4, [2, 2, 2, 2]), (10, 4, [3, 3, 3, 1]), (5, 4, [2, 2, 1, 0]), (0, 3, [0, 0, 0])],
)
def test_shard_sizes_matches_torch_chunk(n, parts, expected):
    assert shard_sizes(n, parts) == expected == _chunk_sizes(n, parts)


def test_shard_range():
    assert [shard_range(5, 4, i) for i in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert shard_range(7, 1, 0) == (0, 7)
    # DTensor computes the same (size, offset) for uneven shards.
    from torch.distributed.tensor import Shard

    for i in range(4):
        size, offset = Shard.local_shard_size_and_offset(5, 4, i)
        assert shard_range(5, 4, i) == (offset, offset + size)


def test_local_shard_is_a_view_of_the_rank_part():
    w = torch.arange(7 * 4).reshape(7, 4)
    spec = ShardSpec(0, "tp")
    parts = [local_shard(w, spec, MESH.coords(r), MESH) for r in range(3)]
    assert [p.shape[0] for p in parts] == [3, 3, 1]
    assert torch.equal(parts[1], w[3:6])
    assert parts[1].data_ptr() == w[3].data_ptr()  # a view, not a copy
    col = local_shard(w, ShardSpec(-1, "tp"), {"tp": 2}, MESH)
    assert torch.equal(col, w[:, 4:4])  # 4 columns over 3 ranks: 2, 2, 0
    assert local_shard(w, ShardSpec(), {}, MESH) is w


def test_local_shard_over_expert_axis():
    experts = torch.randn(4, 2, 3)
    coords = {**MESH.coords(3), **MESH.expert_coords(3)}  # ep = 3 % 2 = 1
    assert torch.equal(local_shard(experts, ShardSpec(0, "ep"), coords, MESH), experts[2:])


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_unshard_local_inverts_local_shard(dim):
    w = torch.randn(5, 7, dtype=torch.float64)
    spec = ShardSpec(dim, "tp")
    shards = [local_shard(w, spec, {"tp": i}, MESH) for i in range(3)]
    assert torch.equal(unshard_local(shards, spec), w)


def test_unshard_local_replicated_returns_one_copy():
    w = torch.randn(3)
    out = unshard_local([w, w.clone(), w.clone()], ShardSpec())
    assert out is w


def test_spec_for_exact_glob_and_default():
    q, o = ShardSpec(0, "tp"), ShardSpec(1, "tp")
    plan = {
        "model.layers.*.self_attn.q_proj.weight": q,
        "model.layers.*.self_attn.o_proj.weight": o,
        "model.layers.0.self_attn.q_proj.weight": ShardSpec(),
        "*.mlp.*_proj.weight": q,
        "model.layers.*.mlp.up_proj.weight": q,
    }
    assert spec_for(plan, "model.layers.3.self_attn.q_proj.weight") == q
    assert spec_for(plan, "model.layers.12.self_attn.o_proj.weight") == o
    assert spec_for(plan, "model.layers.0.self_attn.q_proj.weight") == ShardSpec()  # exact wins
    assert spec_for(plan, "model.layers.1.mlp.up_proj.weight") == q  # two patterns, same spec
    assert spec_for(plan, "model.norm.weight") == ShardSpec()
    assert spec_for({}, "anything") == ShardSpec()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(dim=0), "sets only one of dim and axis"),
        (dict(axis="tp"), "sets only one of dim and axis"),
        (dict(dim=0.0, axis="tp"), "dim must be an int"),
        (dict(dim=True, axis="tp"), "dim must be an int"),
        (dict(dim=0, axis="sp"), "axis 'sp' is not a mesh axis; use one of tp, cp"),
        (dict(dim=0, axis="dp_total"), "is not a mesh axis"),
    ],
)
def test_spec_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShardSpec(**kwargs)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((-1, 2, 0), "n must be an int >= 0"),
        ((2.0, 2, 0), "n must be an int >= 0"),
        ((4, 0, 0), "parts must be an int >= 1"),
        ((4, 2, 2), r"index 2 is out of range; use 0 <= index < 2"),
        ((4, 2, -1), "out of range"),
    ],
)
def test_shard_range_errors(args, match):
    with pytest.raises(ValueError, match=match):
        shard_range(*args)


def test_shard_sizes_errors():
    with pytest.raises(ValueError, match="parts must be an int >= 1"):
        shard_sizes(4, 0)
    with pytest.raises(ValueError, match="n must be an int >= 0"):
        shard_sizes(-1, 2)


def test_local_shard_errors():
    w = torch.zeros(4, 4)
    with pytest.raises(ValueError, match=r"dim 2 is out of range for a tensor of shape \[4, 4\]"):
        local_shard(w, ShardSpec(2, "tp"), {"tp": 0}, MESH)
    with pytest.raises(ValueError, match=r"dim 0 is out of range for a tensor of shape \[\]"):
        local_shard(torch.tensor(1.0), ShardSpec(0, "tp"), {"tp": 0}, MESH)
    with pytest.raises(ValueError, match="have no 'ep' entry"):
        local_shard(w, ShardSpec(0, "ep"), MESH.coords(0), MESH)
    with pytest.raises(ValueError, match=r"coordinate tp=3 is out of range for tp=3"):
        local_shard(w, ShardSpec(0, "tp"), {"tp": 3}, MESH)


def test_unshard_local_errors():
    with pytest.raises(ValueError, match="got no shards"):
        unshard_local([], ShardSpec(0, "tp"))
    with pytest.raises(ValueError, match="replica 1 differs from replica 0"):
        unshard_local([torch.zeros(2), torch.ones(2)], ShardSpec())
    with pytest.raises(ValueError, match="replica 1 differs"):
        unshard_local([torch.zeros(2), torch.zeros(2, dtype=torch.float64)], ShardSpec())
    with pytest.raises(ValueError, match=r"shard 1 has shape \[2, 4\] but shard 0 has \[2, 3\]"):
        unshard_local([torch.zeros(2, 3), torch.zeros(2, 4)], ShardSpec(0, "tp"))
    with pytest.raises(ValueError, match="shard 1 has shape"):
        unshard_local([torch.zeros(2, 3), torch.zeros(6)], ShardSpec(0, "tp"))
    with pytest.raises(ValueError, match=r"shard 1 has dtype torch\.float64"):
        unshard_local([torch.zeros(2), torch.zeros(2, dtype=torch.float64)], ShardSpec(0, "tp"))
    with pytest.raises(ValueError, match="dim 1 is out of range"):
        unshard_local([torch.zeros(2), torch.zeros(2)], ShardSpec(1, "tp"))


def test_spec_for_errors():
    plan = {"*.weight": ShardSpec(0, "fsdp"), "model.*": ShardSpec(0, "tp")}
    with pytest.raises(ValueError, match="matches patterns with different specs"):
        spec_for(plan, "model.embed.weight")
    assert spec_for(plan, "lm_head.weight") == ShardSpec(0, "fsdp")
    with pytest.raises(TypeError, match="plan entry 'a' is 'colwise', not a ShardSpec"):
        spec_for({"a": "colwise"}, "a")  # type: ignore[dict-item]


def _pieces(tensor, specs, mesh):
    out = {}
    for r in range(mesh.world_size):
        coords, piece = {**mesh.coords(r), **mesh.expert_coords(r)}, tensor
        for spec in specs:
            piece = local_shard(piece, spec, coords, mesh)
        out[r] = piece
    return out


def test_unshard_pieces_undoes_tp_then_an_uneven_data_split():
    mesh = Mesh(dp=2, fsdp=3, tp=2)
    w = torch.arange(10 * 4).reshape(10, 4)
    specs = (ShardSpec(1, "tp"), ShardSpec(0, "fsdp"))
    pieces = _pieces(w, specs, mesh)
    assert pieces[mesh.rank(tp=1, fsdp=2, dp=1)].shape == (2, 2)  # rows 8..9 of columns 2..3
    assert torch.equal(unshard_pieces(pieces, specs, mesh), w)
    assert unshard_pieces({0: w}, (ShardSpec(),), Mesh()) is w


def test_unshard_pieces_over_expert_axes():
    mesh = Mesh(tp=2, dp=2, ep=2)
    w = torch.randn(4, 6)
    specs = (ShardSpec(0, "ep"), ShardSpec(1, "etp"))
    assert torch.equal(unshard_pieces(_pieces(w, specs, mesh), specs, mesh), w)


def test_unshard_pieces_errors():
    mesh = Mesh(tp=2, dp=2)
    w = torch.arange(8.0)
    pieces = _pieces(w, (ShardSpec(0, "tp"),), mesh)
    with pytest.raises(ValueError, match=r"missing \[3\], unknown \[\]"):
        unshard_pieces({r: p for r, p in pieces.items() if r != 3}, (ShardSpec(0, "tp"),), mesh)
    with pytest.raises(ValueError, match=r"missing \[\], unknown \[4\]"):
        unshard_pieces({**pieces, 4: w}, (ShardSpec(0, "tp"),), mesh)
    with pytest.raises(ValueError, match="split over one axis twice"):
        unshard_pieces(pieces, (ShardSpec(0, "tp"), ShardSpec(0, "tp")), mesh)
    with pytest.raises(ValueError, match="replica 2 differs from replica 0"):
        unshard_pieces({**pieces, 2: pieces[2] + 1}, (ShardSpec(0, "tp"),), mesh)
