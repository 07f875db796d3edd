import math
import sys
import types

import pytest
import torch
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType

from twinkle_fn import varlen_attention
from twinkle_fn.backends.megatron import cpu_compat
from twinkle_fn.backends.megatron.attention import SDPAAttention

HEADS, GROUPS, DIM = 4, 2, 8


def _config(**overrides) -> TransformerConfig:
    fields = dict(
        num_layers=2,
        hidden_size=HEADS * DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=DIM,
        normalization="RMSNorm",
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    return TransformerConfig(**{**fields, **overrides})


def _qkv(sq, b, sk=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    sk = sq if sk is None else sk
    q = torch.randn(sq, b, HEADS, DIM, generator=g)
    k = torch.randn(sk, b, GROUPS, DIM, generator=g)
    v = torch.randn(sk, b, GROUPS, DIM, generator=g)
    return q, k, v


def _naive(q, k, v, allowed):
    """float64 softmax attention; q [sq, b, n, d], k/v [sk, b, g, d], allowed [b, sq, sk]."""
    q, k, v = (t.double() for t in (q, k, v))
    k = k.repeat_interleave(HEADS // GROUPS, dim=2)
    v = v.repeat_interleave(HEADS // GROUPS, dim=2)
    scores = torch.einsum("qbnd,kbnd->bnqk", q, k) / math.sqrt(DIM)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    out = torch.einsum("bnqk,kbnd->qbnd", scores.softmax(-1), v)
    return out.reshape(q.shape[0], q.shape[1], -1)


def _causal(sq, sk, b):
    return torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq).expand(b, sq, sk)


# fp32 attention against a float64 reference: rounding only, ~1e-7.
TOL = dict(rtol=0, atol=1e-5)


def _attention(config=None, mask_type=AttnMaskType.causal, layer=1):
    return SDPAAttention(config or _config(), layer, mask_type, "self").eval()


def test_causal_gqa_matches_a_float64_reference():
    q, k, v = _qkv(7, 3)
    out = _attention()(q, k, v, None)
    assert out.shape == (7, 3, HEADS * DIM)
    torch.testing.assert_close(out.double(), _naive(q, k, v, _causal(7, 7, 3)), **TOL)


def test_megatron_padding_mask_combines_with_causality():
    q, k, v = _qkv(6, 2)
    masked = torch.zeros(2, 1, 1, 6, dtype=torch.bool)
    masked[0, ..., 4:] = True  # sample 0: last two keys are padding
    out = _attention()(q, k, v, masked)
    allowed = _causal(6, 6, 2) & ~masked[:, 0]
    torch.testing.assert_close(out[:4].double(), _naive(q, k, v, allowed)[:4], **TOL)
    assert torch.isfinite(out).all()


def test_fully_masked_rows_stay_finite_and_no_mask_is_bidirectional():
    q, k, v = _qkv(5, 1)
    out = _attention()(q, k, v, torch.ones(1, 1, 5, 5, dtype=torch.bool))
    assert torch.isfinite(out).all()
    full = _attention(mask_type=AttnMaskType.no_mask)(q, k, v, None)
    everything = torch.ones(1, 5, 5, dtype=torch.bool)
    torch.testing.assert_close(full.double(), _naive(q, k, v, everything), **TOL)


def test_queries_after_a_cache_are_bottom_right_aligned():
    q, k, v = _qkv(2, 2, sk=6)
    out = _attention()(q, k, v, None)
    torch.testing.assert_close(out.double(), _naive(q, k, v, _causal(2, 6, 2)), **TOL)


def test_sliding_window_keeps_the_last_left_plus_one_keys():
    q, k, v = _qkv(8, 1)
    out = _attention(_config(window_size=(2, 0)))(q, k, v, None)
    rel = torch.arange(8)[None] - torch.arange(8)[:, None]
    allowed = ((rel <= 0) & (rel >= -2))[None]
    torch.testing.assert_close(out.double(), _naive(q, k, v, allowed), **TOL)
    skip = _config(window_size=(2, 0), window_attn_skip_freq=2)
    assert _attention(skip, layer=2).window is None and _attention(skip, layer=1).window == (2, 0)


def _packed(lens, total=None, padded=None):
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = _qkv(total or int(cu[-1]), 1)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=max(lens),
        max_seqlen_kv=max(lens),
    )
    return (q[:, 0], k[:, 0], v[:, 0]), params, cu


def _per_sample(q, k, v, cu):
    outs = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        sample = (t[s:e, None] for t in (q, k, v))
        outs.append(_naive(*sample, _causal(e - s, e - s, 1))[:, 0])
    return torch.cat(outs)


def test_packed_sequences_attend_causally_within_each_sample():
    (q, k, v), params, cu = _packed([3, 5, 1, 4])
    out = _attention()(q, k, v, None, packed_seq_params=params)
    assert out.shape == (13, HEADS * DIM)
    torch.testing.assert_close(out.double(), _per_sample(q, k, v, cu), **TOL)


def test_packed_padding_follows_the_padded_boundaries_and_the_tail_is_zero():
    padded = torch.tensor([0, 4, 8], dtype=torch.int32)  # samples of 3 and 2 tokens, padded to 4
    (q, k, v), params, _ = _packed([3, 2], total=10, padded=padded)
    out = _attention()(q, k, v, None, packed_seq_params=params)
    torch.testing.assert_close(out[:8].double(), _per_sample(q[:8], k[:8], v[:8], padded), **TOL)
    assert torch.equal(out[8:], torch.zeros(2, HEADS * DIM))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's varlen kernel needs CUDA")
def test_packed_bf16_on_cuda_takes_torchs_varlen_kernel(monkeypatch):
    """Without flash-attn, bf16 THD on CUDA runs torch's varlen kernel (never the per-sample
    loop); the padded tail is zero. Tolerance: bf16 output, 8 mantissa bits at |out| < 3."""
    assert varlen_attention.FLASH_VARLEN is None and varlen_attention.TORCH_VARLEN
    monkeypatch.setattr(SDPAAttention, "_attend", lambda *a: pytest.fail("per-sample SDPA ran"))
    padded = torch.tensor([0, 4, 8], dtype=torch.int32)
    (q, k, v), params, _ = _packed([3, 2], total=10, padded=padded)
    cuda = [t.cuda().bfloat16() for t in (q, k, v)]
    params.cu_seqlens_q_padded = params.cu_seqlens_kv_padded = padded.cuda()
    out = _attention()(*cuda, None, packed_seq_params=params)
    want = _per_sample(q[:8], k[:8], v[:8], padded)
    torch.testing.assert_close(out[:8].double().cpu(), want, rtol=0, atol=2e-2)
    assert torch.equal(out[8:].cpu(), torch.zeros(2, HEADS * DIM, dtype=torch.bfloat16))


def test_flash_varlen_is_used_when_importable_for_half_precision(monkeypatch):
    calls = []

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        calls.append((cu_q, max_q, kwargs))
        return torch.zeros_like(q)

    assert varlen_attention.FLASH_VARLEN is None  # flash-attn cannot be installed on a CPU
    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    # what the import-time lookup finds with flash-attn installed
    monkeypatch.setattr(varlen_attention, "FLASH_VARLEN", varlen_attention._flash_varlen())
    (q, k, v), params, cu = _packed([3, 5])
    attention = _attention()
    out = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, packed_seq_params=params)
    assert torch.equal(out, torch.zeros(8, HEADS * DIM, dtype=torch.bfloat16))
    [(cu_q, max_q, kwargs)] = calls
    assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu) and max_q == 5
    assert kwargs["causal"] and kwargs["window_size"] == (-1, -1)
    assert kwargs["softmax_scale"] == pytest.approx(1 / math.sqrt(DIM))
    fp32 = attention(q, k, v, None, packed_seq_params=params)  # flash has no fp32 kernel
    assert len(calls) == 1
    torch.testing.assert_close(fp32.double(), _per_sample(q, k, v, cu), **TOL)


def test_dropout_draws_from_the_model_parallel_rng_stream():
    q, k, v = _qkv(6, 2)
    attention = SDPAAttention(_config(attention_dropout=0.5), 1, AttnMaskType.causal, "self")
    with cpu_compat.cpu_mode():
        outs = []
        for _ in range(2):
            tracker = tensor_parallel.get_cuda_rng_tracker()
            tracker.reset()
            tracker.add("model-parallel-rng", 123)
            torch.manual_seed(0)
            outs.append(attention.train()(q, k, v, None))
            # The default CPU stream is untouched by dropout inside the fork.
            assert torch.equal(torch.rand(3), torch.rand(3, generator=_seeded(0)))
    assert torch.equal(outs[0], outs[1])
    assert not torch.allclose(outs[0], attention.eval()(q, k, v, None))


def _seeded(seed):
    return torch.Generator().manual_seed(seed)


def test_unsupported_attention_options_are_refused():
    cp2 = _config(context_parallel_size=2, window_size=(2, 0))
    with pytest.raises(ValueError, match="cp_comm_type='p2p'"):
        SDPAAttention(cp2, 1, AttnMaskType.causal, "self", cp_comm_type="p2p")
    # Refused before the context-parallel group is used (context_parallel_test runs it).
    group = types.SimpleNamespace(cp=object())
    q, k, v = _qkv(4, 1)
    causal = SDPAAttention(cp2, 1, AttnMaskType.causal, "self", pg_collection=group)
    with pytest.raises(ValueError, match="takes no attention_mask"):
        causal(q, k, v, torch.zeros(1, 1, 4, 8, dtype=torch.bool))
    bidirectional = SDPAAttention(cp2, 1, AttnMaskType.no_mask, "self", pg_collection=group)
    with pytest.raises(ValueError, match="sliding windows with the causal mask only"):
        bidirectional(q, k, v, None)
    q, k, v = _qkv(3, 1)
    with pytest.raises(ValueError, match="attention_bias"):
        _attention()(q, k, v, None, attention_bias=torch.zeros(1))


def test_packed_key_value_bounds_must_be_the_querys():
    (q, k, v), params, cu = _packed([3, 5])
    params.cu_seqlens_kv = cu.clone()  # equal values in another tensor: compared, accepted
    torch.testing.assert_close(
        _attention()(q, k, v, None, packed_seq_params=params).double(),
        _per_sample(q, k, v, cu),
        **TOL,
    )
    params.cu_seqlens_kv = torch.tensor([0, 4, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q must equal _kv"):
        _attention()(q, k, v, None, packed_seq_params=params)
