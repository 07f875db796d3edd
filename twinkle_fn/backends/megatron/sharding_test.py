"""Whole HF tensors cut into each rank's megatron tensors by the bridge and joined back: on one
process, and against what megatron-core's ``GPTModel`` really holds on each of 2 gloo ranks."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import twinkle_fn as tf
from twinkle_fn.backends.megatron.bridge import hf_to_mcore
from twinkle_fn.backends.megatron.sharding import (
    checkpoint_names,
    shard_params,
    unshard_params,
    vocab_multiple,
)
from twinkle_fn.models.model import Model
from twinkle_fn.testing import tiny_config
from twinkle_fn.testing_dist import spawn


def _model(family="qwen2", options=None, **overrides):
    # A Model built by hand: the pure functions need the config, module and options only, so
    # megatron-core is not imported.
    torch.manual_seed(0)
    module = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    return Model(module, family, backend="megatron", options=options or {})


def test_a_rank_gets_the_bridge_tensors_of_its_coordinates():
    model = _model()
    full = model.module.state_dict()
    mesh = tf.Mesh(tp=2, dp=2, pp=2)
    r = mesh.rank(tp=1, dp=1, pp=1)
    mine = shard_params(full, mesh, model, r)
    want = hf_to_mcore(full, model.config, tp_rank=1, tp_size=2, pp_rank=1, pp_size=2)
    assert mine.keys() == want.keys() and all(torch.equal(mine[n], want[n]) for n in want)
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in mine  # global layer 1
    assert "embedding.word_embeddings.weight" not in mine  # on the first stage only
    assert mine["output_layer.weight"].shape == (128, 32)  # 96 rows padded to 2 x 128


def test_fused_in_memory_experts_are_cut_like_checkpoint_names():
    model = _model("qwen3_moe")
    in_memory = model.module.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in in_memory
    mesh = tf.Mesh(tp=2, ep=2)
    for r in range(mesh.world_size):
        a = shard_params(in_memory, mesh, model, r)
        b = shard_params(checkpoint_names(model, in_memory), mesh, model, r)
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
        # 4 experts over ep=2: two local experts, each fc1 cut over etp=1 (whole).
        assert a["decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"].shape == (32, 32)


def test_vocab_multiple_option_pads_the_vocabulary_and_round_trips():
    model = _model(options={"vocab_multiple": 7}, tie_word_embeddings=True)
    full = checkpoint_names(model, model.module.state_dict())
    mesh = tf.Mesh(tp=2, pp=2)
    pieces = {r: shard_params(full, mesh, model, r) for r in range(mesh.world_size)}
    # 96 rows padded to a multiple of 7 x 2 = 98: 49 per tp rank, zeros past row 96.
    embed = pieces[mesh.rank(tp=1)]["embedding.word_embeddings.weight"]
    assert embed.shape == (49, 32) and torch.equal(embed[47:], torch.zeros(2, 32))
    # The tied copy of the embedding lives on the last stage and is not exported again.
    assert "output_layer.weight" in pieces[mesh.rank(pp=1)]
    back = unshard_params(pieces, mesh, model)
    assert back.keys() == full.keys() - {"lm_head.weight"}
    assert all(torch.equal(back[n], full[n]) for n in back)


def test_errors():
    model = _model()
    mesh = tf.Mesh(tp=2)
    full = model.module.state_dict()
    pieces = {r: shard_params(full, mesh, model, r) for r in range(2)}
    with pytest.raises(ValueError, match=r"missing \[1\], unknown \[\]"):
        unshard_params({0: pieces[0]}, mesh, model)
    with pytest.raises(ValueError, match=r"rank 2 is out of range"):
        shard_params(full, mesh, model, 2)
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' is missing"):
        shard_params({n: t for n, t in full.items() if n != "model.norm.weight"}, mesh, model, 0)
    with pytest.raises(ValueError, match="option vocab_multiple must be a positive int, got 0"):
        vocab_multiple({"vocab_multiple": 0})
    assert vocab_multiple({}) == 128


# name -> (config overrides, mesh sizes): tp splits and pads the vocabulary; pp with tied
# embeddings puts the embedding's copy on the last stage.
MESHES = {"tp2": ({}, {"tp": 2}), "pp2": ({"tie_word_embeddings": True}, {"pp": 2})}


def _shard_matches_live():
    from twinkle_fn.backends.megatron import parallel

    out = {}
    for name, (overrides, sizes) in MESHES.items():
        mesh = tf.Mesh(**sizes)
        model = tf.models.from_hf_config(
            tiny_config("qwen2", **overrides), seed=0, backend="megatron"
        )
        full = {n: t.detach().clone() for n, t in model.module.state_dict().items()}
        state = tf.init(model, tf.optim.adamw(1e-3), mesh)
        mine = tf.shard(full, mesh, model)
        live = {n: p.detach() for n, p in state.params.items()}
        back = tf.unshard(mine, mesh, model)
        out[name] = dict(
            names=sorted(mine) == sorted(live),
            mismatched=[n for n in live if n not in mine or not torch.equal(mine[n], live[n])],
            left_out=sorted(full.keys() - back.keys()),
            round_trip=all(torch.equal(back[n], full[n]) for n in back),
            shapes={n: tuple(t.shape) for n, t in live.items() if "layers" not in n},
        )
        parallel.destroy()
    return out


def test_tf_shard_of_the_initial_weights_is_what_each_rank_holds():
    for rank, out in enumerate(spawn(_shard_matches_live, 2, timeout_s=300)):
        for name, got in out.items():
            assert got["names"] and got["mismatched"] == [] and got["round_trip"], name
        assert out["tp2"]["left_out"] == [] and out["pp2"]["left_out"] == ["lm_head.weight"]
        # tp=2 pads 96 vocabulary rows to 256 (128 per rank); pp=2 splits the stages.
        assert out["tp2"]["shapes"]["embedding.word_embeddings.weight"] == (128, 32)
        stage = {0: "embedding.word_embeddings.weight", 1: "output_layer.weight"}[rank]
        assert stage in out["pp2"]["shapes"]
