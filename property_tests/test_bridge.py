"""HF <-> megatron-core bridge invariants over small random shapes.

The fused layouts are checked against independent references of what megatron-core does with
them (its per-group view and split of ``linear_qkv``'s output, its per-rank chunk of
``linear_fc1``'s output), and whole models round-trip bit-exactly over random layouts.
"""

import itertools

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from twinkle_fn.backends.megatron.bridge import hf_to_mcore, mcore_to_hf
from twinkle_fn.backends.megatron.bridge_transforms import (
    fuse_gate_up,
    fuse_qkv,
    split_gate_up,
    split_qkv,
    tp_shard,
    tp_unshard,
)
from twinkle_fn.testing import tiny_config

SETTINGS = settings(max_examples=60, deadline=None)


def _qkv_valid(heads: int, kv: int, head_dim: int, tp: int) -> bool:
    # megatron-core splits whole query groups, or with fewer kv heads than ranks, replicates them.
    if kv >= tp:
        return kv % tp == 0
    return tp % kv == 0 and heads % tp == 0 and (kv * (heads // kv + 2) * head_dim) % tp == 0


@st.composite
def attention(draw: st.DrawFn) -> tuple[int, int, int, int, int]:
    kv, per_group = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    head_dim, cols, tp = (
        draw(st.integers(1, 5)),
        draw(st.integers(1, 3)),
        draw(st.sampled_from([1, 2, 4])),
    )
    assume(_qkv_valid(kv * per_group, kv, head_dim, tp))
    return kv * per_group, kv, head_dim, cols, tp


def _megatron_reads(shards: list[torch.Tensor], rank: int, heads: int, kv: int, hd: int):
    """The q, k, v rows that megatron-core's attention of `rank` uses (weight rows as features).

    Mirrors ``SelfAttention.get_query_key_value_tensors``: view the local output as
    ``[groups, (q_per_group + 2) * head_dim]`` and split; with fewer kv heads than ranks, first
    all-gather, take group ``rank // (tp / kv)``, then its q heads ``rank % (tp / kv)``.
    """
    tp = len(shards)
    if kv < tp:
        full = torch.cat(shards)
        size = full.shape[0] // kv
        local = full[rank // (tp // kv) * size : (rank // (tp // kv) + 1) * size]
        groups, q_heads = 1, heads // kv
    else:
        local, groups, q_heads = shards[rank], kv // tp, heads // tp
    grouped = local.reshape(groups, (q_heads // groups + 2) * hd, -1)
    q, k, v = grouped.split([q_heads // groups * hd, hd, hd], dim=1)
    q, k, v = (t.reshape(-1, t.shape[-1]) for t in (q, k, v))
    if kv < tp:
        part = heads // tp * hd
        idx = rank % (tp // kv)
        q = q[idx * part : (idx + 1) * part]
    return q, k, v


@SETTINGS
@given(attention())
def test_qkv_layout_is_what_megatron_attention_reads(dims):
    heads, kv, hd, cols, tp = dims
    q, k, v = (torch.randn(n * hd, cols) for n in (heads, kv, kv))
    fused = fuse_qkv(q, k, v, heads, kv, hd)
    # An independent reference of the interleaving: per group, its q heads, then k, then v.
    per = heads // kv
    reference = torch.cat(
        [
            torch.cat(
                [
                    q[g * per * hd : (g + 1) * per * hd],
                    k[g * hd : (g + 1) * hd],
                    v[g * hd : (g + 1) * hd],
                ]
            )
            for g in range(kv)
        ]
    )
    assert torch.equal(fused, reference)
    assert all(
        torch.equal(a, b) for a, b in zip(split_qkv(fused, heads, kv, hd), (q, k, v), strict=True)
    )
    shards = [tp_shard(fused, 0, r, tp) for r in range(tp)]
    for rank in range(tp):
        got_q, got_k, got_v = _megatron_reads(shards, rank, heads, kv, hd)
        q_rows = heads // tp * hd
        group = rank * kv // tp if kv >= tp else rank // (tp // kv)
        kv_rows = slice(group * hd, (group + max(kv // tp, 1)) * hd)
        assert torch.equal(got_q, q[rank * q_rows : (rank + 1) * q_rows])
        assert torch.equal(got_k, k[kv_rows]) and torch.equal(got_v, v[kv_rows])


@SETTINGS
@given(st.integers(1, 6), st.integers(1, 3), st.sampled_from([1, 2, 3, 4]))
def test_fc1_per_rank_chunks_are_that_ranks_gate_and_up(ffn_per_rank, cols, tp):
    gate, up = torch.randn(ffn_per_rank * tp, cols), torch.randn(ffn_per_rank * tp, cols)
    fc1 = [fuse_gate_up(tp_shard(gate, 0, r, tp), tp_shard(up, 0, r, tp)) for r in range(tp)]
    for rank, local in enumerate(fc1):
        # megatron-core's MLP: x_glu, x_linear = torch.chunk(local_output, 2, dim=-1)
        glu, linear = torch.chunk(local, 2, dim=0)
        rows = slice(rank * ffn_per_rank, (rank + 1) * ffn_per_rank)
        assert torch.equal(glu, gate[rows]) and torch.equal(linear, up[rows])
    gates, ups = zip(*(split_gate_up(t) for t in fc1), strict=True)
    assert torch.equal(tp_unshard(gates, 0), gate) and torch.equal(tp_unshard(ups, 0), up)


@SETTINGS
@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), st.integers(1, 4), st.data())
def test_tp_shard_unshard_round_trip(shape, size, data):
    dim = data.draw(st.integers(0, len(shape) - 1))
    shape[dim] *= size
    t = torch.randn(shape)
    shards = [tp_shard(t, dim, r, size) for r in range(size)]
    assert all(s.shape[dim] == shape[dim] // size for s in shards)
    assert torch.equal(tp_unshard(shards, dim), t)


def _on_disk(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # transformers fuses a Qwen3-MoE layer's experts in memory ([E, 2F, H] gate_up, [E, H, F]
    # down); checkpoints hold one gate/up/down per expert, which is what the bridge reads.
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            gates, ups = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = gates[e]
                out[f"{prefix}{e}.up_proj.weight"] = ups[e]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e, down in enumerate(t):
                out[f"{prefix}{e}.down_proj.weight"] = down
        else:
            out[name] = t
    return out


@st.composite
def model_and_mesh(draw: st.DrawFn):
    family = draw(st.sampled_from(["llama", "qwen2", "qwen3", "qwen3_moe"]))
    heads, kv, hd, _, tp = draw(attention())
    pp, ep = (
        draw(st.sampled_from([1, 2])),
        draw(st.sampled_from([1, 2])) if family == "qwen3_moe" else 1,
    )
    overrides = dict(
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hd * 2,
        hidden_size=heads * hd * 2,
        num_hidden_layers=pp * draw(st.integers(1, 2)),
        intermediate_size=tp * draw(st.integers(1, 3)),
        vocab_size=draw(st.integers(3, 300)),
        tie_word_embeddings=draw(st.booleans()),
    )
    etp = draw(st.sampled_from([1, tp])) if family == "qwen3_moe" else 1
    if family == "qwen3_moe":
        overrides.update(num_experts=ep * draw(st.integers(1, 2)), moe_intermediate_size=tp * 2)
    assume(_qkv_valid(heads, kv, hd * 2, tp))
    multiple = draw(st.sampled_from([1, 8, 128]))
    return (
        tiny_config(family, **overrides),
        dict(tp_size=tp, pp_size=pp, ep_size=ep, etp_size=etp),
        multiple,
    )


@settings(max_examples=40, deadline=None)
@given(model_and_mesh())
def test_whole_model_round_trips_over_random_layouts(setup):
    cfg, layout, multiple = setup
    tp, pp, ep = layout["tp_size"], layout["pp_size"], layout["ep_size"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    state = _on_disk(dict(model.state_dict()))
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    local = {
        (t, p, e): hf_to_mcore(
            state, cfg, tp_rank=t, pp_rank=p, ep_rank=e, vocab_multiple=multiple, **layout
        )
        for t, p, e in itertools.product(range(tp), range(pp), range(ep))
    }
    embed = local[(0, 0, 0)]["embedding.word_embeddings.weight"]
    padded = embed.shape[0] * tp
    assert (
        padded % (multiple * tp) == 0 and cfg.vocab_size <= padded < cfg.vocab_size + multiple * tp
    )
    back = dict(mcore_to_hf(local, cfg, vocab_multiple=multiple, **layout))
    assert back.keys() == state.keys()
    for name, t in state.items():
        assert torch.equal(back[name], t), name
