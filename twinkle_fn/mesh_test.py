import pytest

from twinkle_fn.mesh import COORD_AXES, GROUP_NAMES, Mesh

# tp=2 x cp=1 x fsdp=2 x dp=2 x pp=2 = 16 ranks; written out by hand from
# rank = tp + 2*(fsdp + 2*(dp + 2*pp)) so the expectations do not reuse the code under test.
HSDP = Mesh(dp=2, fsdp=2, tp=2, pp=2, ep=2)


def test_defaults_are_one_rank():
    m = Mesh()
    assert m.world_size == 1 and m.data_world_size == 1 and m.edp == 1
    assert m.coords(0) == dict(tp=0, cp=0, ulysses=0, fsdp=0, dp=0, pp=0)
    assert m.group_ranks("tp") == [[0]]


def test_world_and_sizes():
    assert HSDP.world_size == 16
    assert HSDP.data_world_size == 4
    assert HSDP.edp == 4  # 16 // (etp=1 * ep=2 * pp=2)
    assert HSDP.sizes == dict(tp=2, cp=1, ulysses=1, fsdp=2, dp=2, pp=2, etp=1, ep=2, edp=4)
    assert tuple(HSDP.sizes) == COORD_AXES


def test_coords_follow_tp_cp_fsdp_dp_pp_order():
    assert HSDP.coords(1) == dict(tp=1, cp=0, ulysses=0, fsdp=0, dp=0, pp=0)
    assert HSDP.coords(2) == dict(tp=0, cp=0, ulysses=0, fsdp=1, dp=0, pp=0)
    assert HSDP.coords(4) == dict(tp=0, cp=0, ulysses=0, fsdp=0, dp=1, pp=0)
    assert HSDP.coords(8) == dict(tp=0, cp=0, ulysses=0, fsdp=0, dp=0, pp=1)
    assert HSDP.coords(15) == dict(tp=1, cp=0, ulysses=0, fsdp=1, dp=1, pp=1)
    m = Mesh(tp=2, cp=3)
    assert m.coords(5) == dict(tp=1, cp=2, ulysses=0, fsdp=0, dp=0, pp=0)


def test_rank_is_inverse_of_coords_and_defaults_to_zero():
    assert HSDP.rank(tp=1, fsdp=1, dp=1, pp=1) == 15
    assert HSDP.rank(dp=1) == 4
    assert HSDP.rank() == 0
    assert all(HSDP.rank(**HSDP.coords(r)) == r for r in range(16))


def test_expert_coords_follow_etp_ep_edp_pp_order():
    m = Mesh(dp=4, tp=2, ep=2, etp=2)  # 8 ranks, edp = 8 // 4 = 2
    assert m.expert_coords(1) == dict(etp=1, ep=0, edp=0, pp=0)
    assert m.expert_coords(2) == dict(etp=0, ep=1, edp=0, pp=0)
    assert m.expert_coords(4) == dict(etp=0, ep=0, edp=1, pp=0)
    assert m.expert_rank(etp=1, ep=1, edp=1) == 7
    assert all(m.expert_rank(**m.expert_coords(r)) == r for r in range(8))


def test_dense_groups():
    assert HSDP.group_ranks("tp") == [[2 * i, 2 * i + 1] for i in range(8)]
    assert HSDP.group_ranks("fsdp")[:2] == [[0, 2], [1, 3]]
    assert HSDP.group_ranks("dp")[:2] == [[0, 4], [1, 5]]
    assert HSDP.group_ranks("pp")[:2] == [[0, 8], [1, 9]]
    assert HSDP.group_ranks("cp") == [[r] for r in range(16)]
    assert HSDP.group_ranks("dp_total") == [
        [0, 2, 4, 6],
        [1, 3, 5, 7],
        [8, 10, 12, 14],
        [9, 11, 13, 15],
    ]
    assert HSDP.group_ranks(("fsdp", "dp")) == HSDP.group_ranks("dp_total")
    assert HSDP.group_ranks("mp")[:2] == [[0, 1, 8, 9], [2, 3, 10, 11]]
    assert HSDP.group_ranks(()) == [[r] for r in range(16)]


def test_expert_groups():
    # ep=2, etp=1, edp=4, pp=2: rank = ep + 2*(edp + 4*pp)
    assert HSDP.group_ranks("ep")[:2] == [[0, 1], [2, 3]]
    assert HSDP.group_ranks("etp") == [[r] for r in range(16)]
    assert HSDP.group_ranks("edp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert HSDP.group_ranks(("etp", "ep", "pp"))[0] == [0, 1, 8, 9]
    assert HSDP.group_ranks(("ep", "pp")) == HSDP.group_ranks(("etp", "ep", "pp"))


def test_groups_of_reports_every_name():
    g = HSDP.groups_of(5)  # tp=1, fsdp=0, dp=1, pp=0; ep=1, edp=2
    assert tuple(g) == GROUP_NAMES
    assert g["tp"] == [4, 5]
    assert g["cp"] == [5]
    assert g["fsdp"] == [5, 7]
    assert g["dp"] == [1, 5]
    assert g["pp"] == [5, 13]
    assert g["dp_total"] == [1, 3, 5, 7]
    assert g["mp"] == [4, 5, 12, 13]
    assert g["ep"] == [4, 5]
    assert g["etp"] == [5]
    assert g["edp"] == [1, 3, 5, 7]
    for name, group in g.items():
        assert group in HSDP.group_ranks(name)


def test_data_rank_is_dp_times_fsdp_plus_fsdp():
    assert [HSDP.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert HSDP.data_rank(15) == 3  # pp peers share it


def test_get_slice_divmod_split():
    m = Mesh(dp=4)
    # 10 = 4*2 + 2: the first two data ranks get one extra.
    assert [m.get_slice(10, r) for r in range(4)] == [
        slice(0, 3),
        slice(3, 6),
        slice(6, 8),
        slice(8, 10),
    ]
    assert HSDP.get_slice(8, 0) == HSDP.get_slice(8, 1) == HSDP.get_slice(8, 9) == slice(0, 2)
    assert HSDP.get_slice(8, 15) == slice(6, 8)


def test_pipeline_and_tensor_predicates():
    assert HSDP.is_pp_first(7) and not HSDP.is_pp_first(8)
    assert HSDP.is_pp_last(8) and not HSDP.is_pp_last(7)
    assert HSDP.is_tp_last(1) and not HSDP.is_tp_last(2)
    assert Mesh().is_pp_first(0) and Mesh().is_pp_last(0) and Mesh().is_tp_last(0)


def test_from_world_fills_dp():
    assert Mesh.from_world(8, tp=2) == Mesh(dp=4, tp=2)
    assert Mesh.from_world(16, fsdp=2, pp=2, ep=4) == Mesh(dp=4, fsdp=2, pp=2, ep=4)
    assert Mesh.from_world(4, tp=2, sequence_parallel=True).sequence_parallel


def test_mesh_is_frozen_and_hashable():
    with pytest.raises(AttributeError):
        HSDP.tp = 4  # type: ignore[misc]
    assert hash(Mesh(tp=2)) == hash(Mesh(tp=2))


@pytest.mark.parametrize("bad", [0, -1, 1.0, True, "2", None])
@pytest.mark.parametrize("field", ["dp", "fsdp", "tp", "pp", "cp", "ep", "etp"])
def test_bad_size_raises(field, bad):
    with pytest.raises(ValueError, match=f"mesh {field} must be a positive int"):
        Mesh(**{field: bad})


def test_sequence_parallel_errors():
    with pytest.raises(ValueError, match="sequence_parallel=True needs tp > 1"):
        Mesh(dp=2, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence_parallel must be a bool"):
        Mesh(tp=2, sequence_parallel=1)  # type: ignore[arg-type]
    assert Mesh(tp=2, sequence_parallel=True).sequence_parallel


def test_expert_sizes_must_divide_stage():
    with pytest.raises(
        ValueError, match=r"etp=2 x ep=3 = 6 must divide tp x cp x ulysses x fsdp x dp = 8"
    ):
        Mesh(dp=8, ep=3, etp=2)
    with pytest.raises(ValueError, match="must divide"):
        Mesh(dp=2, pp=4, ep=4)  # world 8 but only 2 ranks per stage
    assert Mesh(dp=2, tp=2, ep=4).edp == 1


def test_validate():
    Mesh(dp=2, tp=2).validate(4)
    with pytest.raises(ValueError, match=r"mesh dp=2 x tp=2 = 4 ranks but the world has 8; "):
        Mesh(dp=2, tp=2).validate(8)
    with pytest.raises(ValueError, match=r"mesh dp=1 = 1 ranks but the world has 2"):
        Mesh().validate(2)


def test_from_world_errors():
    with pytest.raises(ValueError, match="fills dp itself"):
        Mesh.from_world(8, dp=2)
    with pytest.raises(ValueError, match=r"a world of 6 ranks cannot hold tp=4 = 4"):
        Mesh.from_world(6, tp=4)
    with pytest.raises(ValueError, match="mesh world_size must be a positive int"):
        Mesh.from_world(0)
    with pytest.raises(ValueError, match="mesh tp must be a positive int"):
        Mesh.from_world(8, tp=0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'xx'"):
        Mesh.from_world(8, xx=2)


@pytest.mark.parametrize("bad", [-1, 16, 2.0, True])
def test_rank_out_of_range_raises(bad):
    for fn in (
        HSDP.coords,
        HSDP.expert_coords,
        HSDP.groups_of,
        HSDP.data_rank,
        HSDP.is_pp_first,
        HSDP.is_pp_last,
        HSDP.is_tp_last,
    ):
        with pytest.raises(ValueError, match=r"out of range for a mesh of 16 ranks"):
            fn(bad)
    with pytest.raises(ValueError, match=r"out of range for a mesh of 16 ranks"):
        HSDP.get_slice(8, bad)


def test_coordinate_out_of_range_raises():
    with pytest.raises(ValueError, match=r"coordinate tp=2 is out of range for tp=2"):
        HSDP.rank(tp=2)
    with pytest.raises(ValueError, match=r"coordinate pp=-1 is out of range"):
        HSDP.rank(pp=-1)
    with pytest.raises(ValueError, match=r"coordinate edp=4 is out of range for edp=4"):
        HSDP.expert_rank(edp=4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'ep'"):
        HSDP.rank(ep=0)  # type: ignore[call-arg]


def test_group_ranks_errors():
    with pytest.raises(ValueError, match=r"unknown mesh axis 'sp'; use one of tp, cp"):
        HSDP.group_ranks("sp")
    with pytest.raises(
        ValueError, match=r"mix the dense layout \(tp\) and the expert layout \(ep\)"
    ):
        HSDP.group_ranks(("tp", "ep"))
    with pytest.raises(ValueError, match="mix the dense layout"):
        HSDP.group_ranks(("dp_total", "edp"))


def test_get_slice_errors():
    with pytest.raises(
        ValueError,
        match=r"a batch of 3 cannot be split over 4 data ranks; use a global batch size that is "
        r"a multiple of 4",
    ):
        Mesh(dp=4).get_slice(3, 0)
    with pytest.raises(ValueError, match="total must be an int"):
        Mesh(dp=4).get_slice(4.0, 0)  # type: ignore[arg-type]


def test_ulysses_sits_between_cp_and_fsdp_and_shares_the_data_shard():
    # rank = tp + 2*(ulysses + 2*fsdp), written out by hand
    m = Mesh(tp=2, ulysses=2, fsdp=2)
    assert m.world_size == 8 and m.data_world_size == 2
    assert m.coords(2) == dict(tp=0, cp=0, ulysses=1, fsdp=0, dp=0, pp=0)
    assert m.coords(4) == dict(tp=0, cp=0, ulysses=0, fsdp=1, dp=0, pp=0)
    assert m.group_ranks("ulysses") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert m.data_rank(2) == m.data_rank(0) == 0 and m.data_rank(4) == 1
    assert Mesh.from_world(4, ulysses=2).dp == 2
