import itertools

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

from twinkle_fn.data.collate import IGNORE_INDEX, pad_collate
from twinkle_fn.data.packing import pack, pack_greedy, packed_attention_mask

FEATURES = [
    {"input_ids": [5, 6, 7], "labels": [6, 7, IGNORE_INDEX]},
    {"input_ids": [8], "labels": [IGNORE_INDEX]},
    {"input_ids": [9, 10, 11, 12, 13], "labels": [IGNORE_INDEX, 11, 12, 13, IGNORE_INDEX]},
]


def test_pack_equals_padded_batch_without_padding():
    packed = pack(FEATURES)
    padded = pad_collate(FEATURES, pad_token_id=0)
    real = padded["attention_mask"].bool()
    for key in ("input_ids", "labels", "position_ids"):
        assert packed[key].dtype == torch.int64
        assert packed[key].shape == (1, 9)
        assert torch.equal(packed[key][0], padded[key][real]), key
    assert "attention_mask" not in packed
    assert packed["cu_seqlens"].dtype == torch.int32
    assert packed["cu_seqlens"].tolist() == [0, 3, 4, 9]
    assert packed["max_seqlen"] == 5 and isinstance(packed["max_seqlen"], int)


def test_pack_positions_restart_per_sample():
    assert pack(FEATURES)["position_ids"][0].tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4]


def test_pack_rejects_malformed_features():
    with pytest.raises(ValueError, match="empty"):
        pack([])
    with pytest.raises(ValueError, match=r"features\[0\] has 2 input_ids but 1 labels"):
        pack([{"input_ids": [1, 2], "labels": [1]}])


def test_packed_attention_mask_is_block_diagonal_causal():
    mask = packed_attention_mask(torch.tensor([0, 2, 3, 6], dtype=torch.int32), 6)
    assert mask.dtype == torch.bool and mask.shape == (1, 1, 6, 6)
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask[0, 0], expected)


def test_packed_attention_isolates_samples_like_separate_sdpa_calls():
    # Attention of the packed row under the mask must equal attention run on each sample alone.
    # float64 keeps the comparison at rounding level (1e-12), far below any leakage.
    torch.manual_seed(0)
    lengths = [3, 1, 4]
    total = sum(lengths)
    q, k, v = (torch.randn(1, 2, total, 8, dtype=torch.float64) for _ in range(3))
    cu_seqlens = pack([{"input_ids": [1] * n, "labels": [1] * n} for n in lengths])["cu_seqlens"]
    packed = F.scaled_dot_product_attention(
        q, k, v, attn_mask=packed_attention_mask(cu_seqlens, total)
    )
    bounds = cu_seqlens.tolist()
    for start, end in itertools.pairwise(bounds):
        alone = F.scaled_dot_product_attention(
            q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], is_causal=True
        )
        torch.testing.assert_close(packed[:, :, start:end], alone, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("cu_seqlens", "total", "match"),
    [
        (torch.tensor([1, 3]), 3, "start at 0"),
        (torch.tensor([0, 3, 2]), 2, "never decrease"),
        (torch.tensor([0, 3]), 4, "ends at 3 but total is 4"),
        (torch.tensor([[0, 3]]), 3, "1-D integer"),
        (torch.tensor([0.0, 3.0]), 3, "1-D integer"),
    ],
)
def test_packed_attention_mask_rejects_bad_cu_seqlens(cu_seqlens, total, match):
    with pytest.raises(ValueError, match=match):
        packed_attention_mask(cu_seqlens, total)


def _features(lengths):
    return [{"input_ids": [1] * n, "labels": [1] * n} for n in lengths]


def test_pack_greedy_first_fit_decreasing():
    # Longest first: 6 -> pack0, 5 -> pack1, 4 -> pack2, 3 -> pack1 (5+3), 2 -> pack0 (6+2),
    # 2 -> pack2 (4+2), 1 -> pack2 (4+2+1).
    lengths = [2, 5, 6, 1, 3, 4, 2]
    packs = pack_greedy(_features(lengths), max_tokens=8)
    assert packs == [[0, 2], [1, 4], [3, 5, 6]]
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in p) <= 8 for p in packs)
    assert pack_greedy(_features(lengths), max_tokens=8) == packs


def test_pack_greedy_errors():
    with pytest.raises(ValueError, match=r"features\[1\] has 9 tokens > max_tokens=8"):
        pack_greedy(_features([2, 9]), max_tokens=8)
    with pytest.raises(ValueError, match="max_tokens must be a positive int"):
        pack_greedy(_features([2]), max_tokens=0)


def test_packed_mask_makes_a_transformers_model_match_the_padded_batch():
    # transformers' SDPA path honours a 4-D bool mask; without it the packed samples would see
    # each other. float64 so the only differences are rounding (observed ~1e-16).
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config).double().eval()
    features = [
        {"input_ids": torch.randint(0, 64, (n,)).tolist(), "labels": [1] * n} for n in (5, 3, 7)
    ]
    packed = pack(features)
    padded = pad_collate(features, pad_token_id=0)
    mask = packed_attention_mask(packed["cu_seqlens"], packed["input_ids"].shape[1])
    with torch.no_grad():
        got = model(
            input_ids=packed["input_ids"], position_ids=packed["position_ids"], attention_mask=mask
        ).logits[0]
        want = model(
            input_ids=padded["input_ids"],
            attention_mask=padded["attention_mask"],
            position_ids=padded["position_ids"],
        ).logits[padded["attention_mask"].bool()]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_pack_concatenates_fields_like_the_labels():
    feats = [
        {**f, "advantages": [float(t) for t in f["input_ids"]], "reward": i}
        for i, f in enumerate(FEATURES)
    ]
    packed = pack(feats)
    padded = pad_collate(feats, pad_token_id=0)
    real = padded["attention_mask"].bool()
    assert packed["advantages"].dtype == torch.float32 and packed["reward"].dtype == torch.int64
    for key in ("advantages", "reward"):
        assert packed[key].shape == packed["labels"].shape == (1, 9)
        assert torch.equal(packed[key][0], padded[key][real]), key
    assert packed["reward"][0].tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 2]
    assert torch.equal(packed["advantages"], packed["input_ids"].float())
