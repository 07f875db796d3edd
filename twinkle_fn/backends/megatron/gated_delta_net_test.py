import pytest
import torch
from megatron.core.ssm.gated_delta_net import common, gdn
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from twinkle_fn.backends.megatron import gated_delta_net as fallback

# [batch, seq, heads, dim]: 2 key heads serving 4 value heads, 150 tokens (3 chunks of 64).
B, T, HK, HV, DK, DV = 2, 150, 2, 4, 8, 8


def _inputs(seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q, k, v = rand(B, T, HK, DK), rand(B, T, HK, DK), rand(B, T, HV, DV)
    g = -torch.rand(B, T, HV, generator=gen, dtype=dtype)  # log decays <= 0
    beta = torch.rand(B, T, HV, generator=gen, dtype=dtype)
    return q, k, v, g, beta


def _ours(q, k, v, g, beta, **kw):
    """megatron's call: q/k l2-normed and repeated to every value head before the kernel."""
    rep = HV // HK
    q, k = (fallback.l2norm(x).repeat_interleave(rep, dim=2) for x in (q, k))
    return fallback.chunk_gated_delta_rule(q, k, v, g, beta, **kw)[0]


def test_the_recurrence_equals_transformers_torch_qwen3_5_paths():
    """float32: transformers' chunked form (another triangular solve) and its token-by-token
    recurrence; observed 6e-8 and 7e-7 (the recurrence sums 150 steps in another order, and is
    itself 7e-7 from the float64 recurrence)."""
    q, k, v, g, beta = _inputs()
    ours = _ours(q, k, v, g, beta)
    chunked, _ = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(ours, chunked, rtol=0, atol=1e-6)
    exact, _ = hf.torch_recurrent_gated_delta_rule(
        *(t.double() for t in (q, k, v, g, beta)), use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(ours.double(), exact, rtol=0, atol=5e-6)


def test_convolution_and_l2norm_equal_transformers():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(B, T, 12, generator=gen), torch.randn(12, 4, generator=gen)
    ours, state = fallback.causal_conv1d(x, w, activation="silu")
    want = hf.causal_conv1d_fn(x.transpose(1, 2), w, activation="silu").transpose(1, 2)
    assert state is None
    torch.testing.assert_close(ours, want, rtol=0, atol=0)
    torch.testing.assert_close(fallback.l2norm(x), hf.l2norm(x), rtol=0, atol=0)


def test_packed_samples_are_computed_alone():
    """cu_seqlens: each sample of a packed row gives what it gives as its own row (the
    convolution and the recurrence restart at every boundary)."""
    q, k, v, g, beta = _inputs(2)
    lens = [5, 70, 1, 74]  # one sample spans two chunks
    cu = torch.tensor([0, 5, 75, 76, 150], dtype=torch.int32)
    row = [t[:1] for t in (q, k, v, g, beta)]
    packed = _ours(*row, cu_seqlens=cu)
    starts = cu[:-1].tolist()
    alone = [_ours(*(t[:, s : s + n] for t in row)) for s, n in zip(starts, lens, strict=True)]
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), rtol=0, atol=1e-6)
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(1, T, 6, generator=gen), torch.randn(6, 4, generator=gen)
    conv, _ = fallback.causal_conv1d(x, w, activation="silu", cu_seqlens=cu)
    each = [
        fallback.causal_conv1d(x[:, s : s + n], w, activation="silu")[0]
        for s, n in zip(starts, lens, strict=True)
    ]
    # the padded batch may take another conv kernel: float32 rounding (observed 7e-9)
    torch.testing.assert_close(conv, torch.cat(each, dim=1), rtol=0, atol=1e-6)


def test_bad_arguments_are_refused_by_name():
    x, w = torch.randn(1, 6, 4), torch.randn(4, 3)
    with pytest.raises(ValueError, match="activation 'gelu'"):
        fallback.causal_conv1d(x, w, activation="gelu")
    with pytest.raises(ValueError, match="cu_seqlens \\[0, 4\\] must run from 0 to the row's 6"):
        fallback.causal_conv1d(x, w, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="keeps no convolution state"):
        fallback.causal_conv1d(x, w, output_final_state=True)


def test_use_kernels_puts_the_fallbacks_where_megatron_reads_them():
    if common.HAVE_FLA and common.chunk_gated_delta_rule is not fallback.chunk_gated_delta_rule:
        assert fallback.use_kernels() == "fla"  # fla importable: megatron's imports stand
        return
    assert fallback.use_kernels() == "torch" and fallback.use_kernels() == "torch"
    assert common.HAVE_FLA and common.l2norm is fallback.l2norm
    for module in (common, gdn):
        assert module.causal_conv1d is fallback.causal_conv1d
        assert module.chunk_gated_delta_rule is fallback.chunk_gated_delta_rule
