"""Whole parameters cut into rank pieces and joined back: on one process, and against what
FSDP2/DTensor really leaves on each of 2 gloo ranks."""

import pytest
import torch
from torch.distributed.tensor import DTensor

import twinkle_fn as tf
from twinkle_fn.backends.transformers.sharding import check_mesh, shard_params, unshard_params
from twinkle_fn.testing import tiny_config
from twinkle_fn.testing_dist import spawn

CFG = tiny_config("qwen2")
Q = "model.layers.1.self_attn.q_proj.weight"  # colwise: [32, 32]
ROW = "model.layers.0.self_attn.o_proj.weight"  # rowwise: [32, 32]
NORM = "model.norm.weight"  # not in the plan: [32]


def _full():
    g = torch.Generator().manual_seed(0)
    shapes = {Q: (32, 32), ROW: (32, 32), NORM: (32,)}
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def test_pieces_are_tp_then_uneven_fsdp_views_of_the_whole_tensors():
    mesh = tf.Mesh(fsdp=3, tp=2)
    full = _full()
    r = mesh.rank(tp=1, fsdp=2)
    mine = shard_params(full, mesh, CFG, r)
    # tp=1 holds rows 16..31 of q (columns 16..31 of o), then fsdp=2 holds the last rows of
    # that: 16 rows split 6, 6, 4; 32 rows split 11, 11, 10.
    assert torch.equal(mine[Q], full[Q][28:32])
    assert torch.equal(mine[ROW], full[ROW][22:32, 16:32])
    assert torch.equal(mine[NORM], full[NORM][22:32])
    assert mine[Q].data_ptr() == full[Q][28].data_ptr()  # a view, no copy
    pieces = {r: shard_params(full, mesh, CFG, r) for r in range(mesh.world_size)}
    back = unshard_params(pieces, mesh, CFG)
    assert back.keys() == full.keys() and all(torch.equal(back[n], full[n]) for n in full)


def test_dp_alone_splits_the_data_axis_like_zero2():
    mesh = tf.Mesh(dp=2)
    mine = shard_params(_full(), mesh, CFG, 1)
    assert torch.equal(mine[NORM], _full()[NORM][16:])


@pytest.mark.parametrize("sizes", [{"pp": 2}, {"cp": 2}])
def test_megatron_axes_are_refused(sizes):
    with pytest.raises(ValueError, match="asks for pp/cp"):
        check_mesh(tf.Mesh(**sizes))
    with pytest.raises(ValueError, match="asks for pp/cp"):
        shard_params(_full(), tf.Mesh(**sizes), CFG, 0)


def test_ep_is_refused_for_a_dense_family():
    # ep splits MoE experts (expert_parallel_test.py); this dense model has none
    with pytest.raises(ValueError, match="mesh ep=2 splits mixture-of-experts layers"):
        shard_params(_full(), tf.Mesh(ep=2, dp=2), CFG, 0)


def test_unshard_params_errors():
    mesh = tf.Mesh(tp=2)
    pieces = {r: shard_params(_full(), mesh, CFG, r) for r in range(2)}
    with pytest.raises(ValueError, match="got no pieces"):
        unshard_params({}, mesh, CFG)
    with pytest.raises(ValueError, match=r"rank 1 holds other names than rank 0"):
        unshard_params({0: pieces[0], 1: {Q: pieces[1][Q]}}, mesh, CFG)
    with pytest.raises(ValueError, match=r"missing \[1\]"):
        unshard_params({0: pieces[0]}, mesh, CFG)
    with pytest.raises(ValueError, match="replica 1 differs"):
        unshard_params({0: pieces[0], 1: {**pieces[1], NORM: pieces[1][NORM] + 1}}, mesh, CFG)
    with pytest.raises(ValueError, match="tp=3 does not divide"):
        shard_params(_full(), tf.Mesh(tp=3), CFG, 0)


# Uneven on fsdp: a 97-row embedding and lm_head split 49 / 48.
MESHES = {"fsdp2": ({"fsdp": 2}, {"vocab_size": 97}), "tp2": ({"tp": 2}, {})}


def _shard_matches_live():
    out = {}
    for name, (sizes, overrides) in MESHES.items():
        mesh = tf.Mesh(**sizes)
        model = tf.models.from_hf_config(tiny_config("qwen2", **overrides), seed=0, device="cpu")
        full = {n: t.detach().clone() for n, t in model.module.state_dict().items()}
        state = tf.init(model, tf.optim.adamw(1e-3), mesh)
        mine = tf.shard(full, mesh, model)
        # Parameters outside the tp plan stay plain tensors on a mesh without a data axis.
        live = {
            n: p.to_local() if isinstance(p, DTensor) else p.detach()
            for n, p in state.params.items()
        }
        back = tf.unshard(mine, mesh, model)
        out[name] = dict(
            names=(sorted(mine) == sorted(live)),
            mismatched=[n for n in live if not torch.equal(mine[n], live[n])],
            shapes={n: tuple(live[n].shape) for n in ("model.embed_tokens.weight", Q, ROW)},
            round_trip=back.keys() == full.keys()
            and all(torch.equal(back[n], full[n]) for n in full),
        )
    return out


def test_tf_shard_of_the_initial_weights_is_what_each_rank_holds():
    for rank, out in enumerate(spawn(_shard_matches_live, 2)):
        for name, got in out.items():
            assert got["names"] and got["mismatched"] == [] and got["round_trip"], name
        embed_rows = (49, 48)[rank]
        assert out["fsdp2"]["shapes"]["model.embed_tokens.weight"] == (embed_rows, 32)
        assert out["tp2"]["shapes"] == {
            "model.embed_tokens.weight": (96, 32),
            Q: (16, 32),
            ROW: (32, 16),
        }
