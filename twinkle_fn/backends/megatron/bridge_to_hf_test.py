"""`mcore_to_hf` and `join_shards` join tensor-parallel shards back into HF tensors and name a
missing rank or tensor; `export_buckets` bounds and orders its buckets. The round trip on every
mesh is `bridge_test`'s."""

import pytest
import torch

from twinkle_fn.backends.megatron.bridge import export_buckets
from twinkle_fn.backends.megatron.bridge_rules import MLP, O_PROJ, QKV
from twinkle_fn.backends.megatron.bridge_test import _all_ranks
from twinkle_fn.backends.megatron.bridge_to_hf import join_shards, mcore_to_hf
from twinkle_fn.backends.megatron.bridge_to_mcore import hf_to_mcore


def test_join_shards_rebuilds_hf_tensors_from_any_rules_tp_shards(hf_checkpoint):
    """What a LoRA export relies on: each rule's transform joins tp shards laid out like its
    megatron tensor (fused qkv, per-rank [gate; up], row-split o_proj) back into HF tensors."""
    cfg, state = hf_checkpoint("qwen2")
    ranks = [hf_to_mcore(state, cfg, tp_rank=t, tp_size=2) for t in range(2)]
    for rule in (QKV, MLP[0], O_PROJ):
        names = [n.format(layer=1) for n in rule.hf]
        shards = [local[rule.mcore.format(layer=1)] for local in ranks]
        joined = join_shards(rule, names, shards, cfg)
        assert [n for n, _ in joined] == names
        assert all(torch.equal(t, state[n]) for n, t in joined)
    with pytest.raises(ValueError, match="takes 3 HF names, got 1"):
        join_shards(QKV, names[:1], shards, cfg)


def test_export_errors_name_the_missing_rank_or_tensor(hf_checkpoint):
    cfg, state = hf_checkpoint("qwen2")
    local = _all_ranks(state, cfg, 2, 1, 1)
    with pytest.raises(ValueError, match="no rank with"):
        list(mcore_to_hf({(0, 0, 0): local[(0, 0, 0)]}, cfg, tp_size=2, pp_size=1))
    broken = {**local, (1, 0, 0): {}}
    with pytest.raises(ValueError, match=r"'embedding\.word_embeddings\.weight' is missing"):
        list(mcore_to_hf(broken, cfg, tp_size=2, pp_size=1))
    with pytest.raises(ValueError, match="pp_rank=1 is out of range"):
        mcore_to_hf({(0, 1, 0): {}}, cfg, tp_size=1, pp_size=1)


def test_export_buckets_bound_size_and_keep_order():
    named = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([3, 3, 10, 1, 1])]
    buckets = list(export_buckets(iter(named), max_bytes=24))
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    assert all(sum(t.nbytes for _, t in b) <= 24 or len(b) == 1 for b in buckets)
    assert list(export_buckets([], 8)) == []
    with pytest.raises(ValueError, match="max_bytes"):
        export_buckets(named, 0)
