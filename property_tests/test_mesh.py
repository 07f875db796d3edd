"""Mesh invariants on random meshes (world <= 64), checked against megatron-core's RankGenerator."""

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron.core.parallel_state import RankGenerator, generate_masked_orthogonal_rank_groups

from twinkle_fn.mesh import COMPOSITE_AXES, DENSE_AXES, EXPERT_AXES, GROUP_NAMES, Mesh

MAX_WORLD = 64
SETTINGS = settings(max_examples=60, deadline=None)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def meshes(draw: st.DrawFn) -> Mesh:
    sizes: dict[str, int] = {}
    # A random drawing order, so that no axis is always left with the smallest bound.
    for name in draw(st.permutations(DENSE_AXES)):
        bound = MAX_WORLD // math.prod(sizes.values(), start=1)
        sizes[name] = draw(st.integers(1, min(8, bound)))
    stage = sizes["tp"] * sizes["cp"] * sizes["fsdp"] * sizes["dp"]
    ep = draw(st.sampled_from(_divisors(stage)))
    etp = draw(st.sampled_from(_divisors(stage // ep)))
    sp = sizes["tp"] > 1 and draw(st.booleans())
    return Mesh(**sizes, ep=ep, etp=etp, sequence_parallel=sp)


def _expand(axes: str | tuple[str, ...]) -> set[str]:
    composites = dict(COMPOSITE_AXES)
    names = (axes,) if isinstance(axes, str) else axes
    return {a for n in names for a in composites.get(n, (n,))}


# Every single name plus a few multi-axis groups Megatron builds (tp-cp, dp-cp, tp-dp-cp, tp-ep-pp).
AXES_TO_CHECK = [*GROUP_NAMES, ("tp", "cp"), ("dp_total", "cp"), ("tp", "dp_total", "cp")]
AXES_TO_CHECK += [("etp", "ep"), ("etp", "ep", "pp"), ("fsdp", "pp"), ()]


@SETTINGS
@given(meshes())
def test_rank_coords_round_trip(mesh):
    dense = [mesh.coords(r) for r in range(mesh.world_size)]
    expert = [mesh.expert_coords(r) for r in range(mesh.world_size)]
    assert [mesh.rank(**c) for c in dense] == list(range(mesh.world_size))
    assert [mesh.expert_rank(**c) for c in expert] == list(range(mesh.world_size))
    sizes = mesh.sizes
    for c in [*dense, *expert]:
        assert all(0 <= v < sizes[k] for k, v in c.items())
    # Both layouts agree on the pipeline stage, as megatron-core asserts for its generators.
    assert all(d["pp"] == e["pp"] for d, e in zip(dense, expert, strict=True))


@SETTINGS
@given(meshes())
def test_groups_partition_world_and_vary_only_named_axes(mesh):
    world = mesh.world_size
    for axes in AXES_TO_CHECK:
        names = _expand(axes)
        coords = mesh.expert_coords if names & {"etp", "ep", "edp"} else mesh.coords
        groups = mesh.group_ranks(axes)
        flat = [r for g in groups for r in g]
        assert sorted(flat) == list(range(world)), axes
        expected_size = math.prod(mesh.sizes[n] for n in names)
        assert all(len(g) == expected_size for g in groups), axes
        for g in groups:
            fixed = [{k: v for k, v in coords(r).items() if k not in names} for r in g]
            assert all(f == fixed[0] for f in fixed), (axes, g)
    for r in range(world):
        for name, group in mesh.groups_of(r).items():
            assert r in group and group in mesh.group_ranks(name)


@SETTINGS
@given(meshes())
def test_dense_groups_match_megatron(mesh):
    gen = RankGenerator(
        tp=mesh.tp, ep=1, dp=mesh.data_world_size, pp=mesh.pp, cp=mesh.cp, order="tp-cp-ep-dp-pp"
    )
    pairs = {
        "tp": "tp",
        "cp": "cp",
        "pp": "pp",
        "dp": "dp_total",
        "tp-pp": "mp",
        "dp-cp": ("dp_total", "cp"),
        "tp-cp": ("tp", "cp"),
        "tp-dp-cp": ("tp", "dp_total", "cp"),
        "tp-dp": ("tp", "dp_total"),
    }
    # Megatron's layout has no ulysses axis (the transformers backend's): compare without it.
    for token, axes in pairs.items() if mesh.ulysses == 1 else ():
        assert mesh.group_ranks(axes) == gen.get_ranks(token), token
    # Megatron has one data axis; split it into fsdp (inner) x dp (outer) for its group maths,
    # with ulysses between cp and fsdp.
    shape = [mesh.tp, mesh.cp, mesh.ulysses, mesh.fsdp, mesh.dp, mesh.pp]
    for axis in DENSE_AXES:
        mask = [a == axis for a in DENSE_AXES]
        expected = generate_masked_orthogonal_rank_groups(mesh.world_size, shape, mask)
        assert mesh.group_ranks(axis) == expected, axis


@SETTINGS
@given(meshes())
def test_expert_groups_match_megatron(mesh):
    gen = RankGenerator(
        tp=mesh.etp, ep=mesh.ep, dp=mesh.edp, pp=mesh.pp, cp=1, order="tp-cp-ep-dp-pp"
    )
    pairs = {
        "ep": "ep",
        "tp": "etp",
        "dp": "edp",
        "pp": "pp",
        "tp-ep": ("etp", "ep"),
        "tp-ep-pp": ("etp", "ep", "pp"),
    }
    for token, axes in pairs.items():
        assert mesh.group_ranks(axes) == gen.get_ranks(token), token
    assert set(EXPERT_AXES) <= set(mesh.sizes)


@SETTINGS
@given(meshes(), st.data())
def test_data_slices_tile_the_batch(mesh, data):
    n = mesh.data_world_size
    total = data.draw(st.integers(n, 4 * n + 7), label="total")
    by_data_rank: dict[int, slice] = {}
    for r in range(mesh.world_size):
        s = mesh.get_slice(total, r)
        assert s.step is None and 0 <= s.start < s.stop <= total
        # tp/cp/pp peers (same data rank) get identical slices.
        assert by_data_rank.setdefault(mesh.data_rank(r), s) == s
    assert sorted(by_data_rank) == list(range(n))
    ordered = [by_data_rank[i] for i in range(n)]
    assert [i for s in ordered for i in range(s.start, s.stop)] == list(range(total))
    # Independent reference for the divmod split: numpy's array_split.
    reference = np.array_split(np.arange(total), n)
    assert [list(range(s.start, s.stop)) for s in ordered] == [a.tolist() for a in reference]
