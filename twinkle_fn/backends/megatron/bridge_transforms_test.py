import pytest
import torch

from twinkle_fn.backends.megatron.bridge_transforms import (
    even_range,
    fuse_gate_up,
    fuse_qkv,
    fuse_sections,
    group_query_gate,
    interleave_query_gate,
    pad_vocab,
    padded_vocab_size,
    split_gate_up,
    split_qkv,
    split_sections,
    tp_shard,
    tp_unshard,
    unpad_vocab,
)


def _heads(n, head_dim, offset):
    # Head i's rows all hold offset + i, so the fused layout is readable row by row.
    return (offset + torch.arange(n)).repeat_interleave(head_dim).float().unsqueeze(1)


def test_fuse_qkv_interleaves_query_groups():
    q, k, v = _heads(4, 2, 0), _heads(2, 2, 10), _heads(2, 2, 20)
    fused = fuse_qkv(q, k, v, num_heads=4, num_kv_heads=2, head_dim=2)
    # group 0: q0 q1 k0 v0, group 1: q2 q3 k1 v1
    expected = [0, 0, 1, 1, 10, 10, 20, 20, 2, 2, 3, 3, 11, 11, 21, 21]
    assert fused.squeeze(1).tolist() == expected
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, 4, 2, 2), (q, k, v), strict=True))


def test_fuse_qkv_works_on_biases_and_multi_query():
    q, k, v = torch.arange(6.0), torch.tensor([6.0, 7.0]), torch.tensor([8.0, 9.0])
    fused = fuse_qkv(q, k, v, num_heads=3, num_kv_heads=1, head_dim=2)
    assert fused.tolist() == list(range(10))
    assert [t.tolist() for t in split_qkv(fused, 3, 1, 2)] == [q.tolist(), k.tolist(), v.tolist()]


def test_qkv_errors():
    q, k = torch.zeros(8, 4), torch.zeros(4, 4)
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        fuse_qkv(torch.zeros(6, 4), k, k, 3, 2, 2)
    with pytest.raises(ValueError, match="k has 4 rows"):
        fuse_qkv(q, k, k, 4, 1, 2)
    with pytest.raises(ValueError, match="fused qkv has 10 rows"):
        split_qkv(torch.zeros(10, 4), 4, 2, 2)
    with pytest.raises(ValueError, match="head_dim"):
        fuse_qkv(q, k, k, 4, 2, 0)


def test_gate_up_fuse_and_split():
    gate, up = torch.randn(3, 5), torch.randn(3, 5)
    fc1 = fuse_gate_up(gate, up)
    assert torch.equal(fc1[:3], gate) and torch.equal(fc1[3:], up)
    g, u = split_gate_up(fc1)
    assert torch.equal(g, gate) and torch.equal(u, up)
    with pytest.raises(ValueError, match="same shape"):
        fuse_gate_up(gate, up[:2])
    with pytest.raises(ValueError, match="odd"):
        split_gate_up(torch.zeros(5, 2))


def test_tp_shard_and_unshard():
    t = torch.arange(24).reshape(4, 6)
    assert torch.equal(tp_shard(t, 1, 2, 3), t[:, 4:6])
    assert tp_shard(t, 0, 1, 2).data_ptr() == t[2].data_ptr()  # a view, no copy
    assert torch.equal(tp_unshard([tp_shard(t, 1, r, 3) for r in range(3)], 1), t)
    assert tp_unshard([t], 0) is t
    assert even_range(12, 2, 4) == (6, 9)
    with pytest.raises(ValueError, match="does not split evenly into 4"):
        tp_shard(t, 1, 0, 4)
    with pytest.raises(ValueError, match="rank 3 is out of range"):
        tp_shard(t, 0, 3, 2)
    with pytest.raises(ValueError, match="no shards"):
        tp_unshard([], 0)


def test_padded_vocab_follows_megatron_lm():
    # Megatron-LM's _vocab_size_with_padding: round up to make_vocab_size_divisible_by * tp.
    assert padded_vocab_size(151936, 1) == 151936
    assert padded_vocab_size(151936, 2) == 152064
    assert padded_vocab_size(32000, 8, 128) == 32768
    assert padded_vocab_size(96, 1) == 128
    assert padded_vocab_size(7, 1, vocab_multiple=1) == 7
    with pytest.raises(ValueError, match="vocab_multiple"):
        padded_vocab_size(96, 1, 0)


def test_pad_and_unpad_vocab():
    t = torch.randn(5, 3, dtype=torch.bfloat16)
    padded = pad_vocab(t, 8)
    assert padded.shape == (8, 3) and padded.dtype == torch.bfloat16
    assert torch.equal(padded[:5], t) and not padded[5:].any()
    assert torch.equal(unpad_vocab(padded, 5), t)
    assert pad_vocab(t, 5) is t
    with pytest.raises(ValueError, match="cannot pad"):
        pad_vocab(t, 4)
    with pytest.raises(ValueError, match="fewer than"):
        unpad_vocab(t, 6)


def test_a_gated_q_proj_is_grouped_as_megatrons_queries_then_gates():
    """HF's Qwen3.5 q_proj rows are [head][query | gate]; megatron's gated linear_qkv wants each
    query group's queries, then its gates (2 heads per group here)."""
    q_proj = torch.cat([torch.cat([_heads(1, 2, 10 + h), _heads(1, 2, 20 + h)]) for h in range(4)])
    grouped = group_query_gate(q_proj, heads_per_group=2, head_dim=2)
    want = [10, 10, 11, 11, 20, 20, 21, 21, 12, 12, 13, 13, 22, 22, 23, 23]
    assert grouped.squeeze(1).tolist() == want
    assert torch.equal(interleave_query_gate(grouped, 2, 2), q_proj)
    with pytest.raises(ValueError, match="not whole groups of 3 heads"):
        group_query_gate(q_proj, heads_per_group=3, head_dim=2)


def test_sections_fuse_per_rank_and_split_back():
    """A Gated DeltaNet in_proj: each rank holds its part of every section, in order."""
    q, k, z = torch.arange(4.0), torch.arange(10.0, 14.0), torch.arange(20.0, 22.0)
    shards = [fuse_sections([q, k, z], rank, 2) for rank in range(2)]
    assert shards[0].tolist() == [0, 1, 10, 11, 20] and shards[1].tolist() == [2, 3, 12, 13, 21]
    back = split_sections(shards, [4, 4, 2])
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, z), strict=True))
    with pytest.raises(ValueError, match="a section of 3 rows does not split evenly into 2"):
        split_sections(shards, [4, 3, 3])
