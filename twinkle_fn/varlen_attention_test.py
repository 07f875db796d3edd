import itertools

import pytest
import torch
import torch.nn.functional as F

from twinkle_fn.data.packing import packed_attention_mask
from twinkle_fn.varlen_attention import TORCH_VARLEN, block_causal_mask, packed_attention

HEADS, GROUPS, DIM = 4, 2, 64
CU = [0, 5, 12, 12, 20]  # an empty sample in the middle


def _qkv(total, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(total, HEADS, DIM, generator=g)
    k = torch.randn(total, GROUPS, DIM, generator=g)
    v = torch.randn(total, GROUPS, DIM, generator=g)
    return [t.to(device, dtype).requires_grad_() for t in (q, k, v)]


def _reference(q, k, v, cu, window=None):
    """Per-sample causal attention in float64: [T, heads, dim]."""
    out = []
    for s, e in itertools.pairwise(cu):
        if e == s:
            continue
        qs, ks, vs = (t[s:e].double().transpose(0, 1) for t in (q, k, v))  # [h, len, d]
        ks, vs = (t.repeat_interleave(HEADS // GROUPS, dim=0) for t in (ks, vs))
        mask = block_causal_mask(torch.tensor([0, e - s], device=q.device), e - s, window)[0, 0]
        out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(0, 1))
    return torch.cat(out)


def test_block_causal_mask_is_the_packing_mask():
    cu = torch.tensor(CU, dtype=torch.int32)
    assert torch.equal(block_causal_mask(cu, 20), packed_attention_mask(cu, 20))


def test_block_causal_mask_window_keeps_the_last_keys_only():
    mask = block_causal_mask(torch.tensor([0, 6]), 6, window=2)[0, 0]
    expected = torch.tensor([[int(0 <= q - k < 2) for k in range(6)] for q in range(6)])
    assert torch.equal(mask.int(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_kernel_on_cpu_without_flash_attn(dtype):
    """On a CPU (no flash-attn, torch's varlen kernel is CUDA-only) the caller falls back."""
    q, k, v = _qkv(20, "cpu", dtype)
    cu = torch.tensor(CU, dtype=torch.int32)
    assert packed_attention(q, k, v, cu, 8, scale=DIM**-0.5) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's varlen kernel needs CUDA")
@pytest.mark.parametrize("window", [None, 3])
def test_torch_varlen_matches_per_sample_attention_on_cuda(window):
    """bf16 GQA through torch's flash kernel against a float64 per-sample reference, forward
    and gradients. Tolerance: bf16 inputs and output (8 mantissa bits) over 64-wide dot
    products, about 1e-2 absolute at unit-variance inputs."""
    assert TORCH_VARLEN is not None
    q, k, v = _qkv(20, "cuda", torch.bfloat16)
    cu = torch.tensor(CU, dtype=torch.int32, device="cuda")
    flash_window = None if window is None else (window - 1, 0)
    out = packed_attention(q, k, v, cu, 8, scale=DIM**-0.5, window=flash_window)
    assert out is not None and out.shape == (20, HEADS, DIM)
    ref = _reference(q, k, v, CU, window)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-2)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w.double(), rtol=0, atol=5e-2)


def test_packed_attention_compiles_into_the_callers_graph():
    """Inside a compiled layer the kernel choice is read from module constants: no import
    attempt or cache lookup that would break the layer's graph (on CPU the traced path ends at
    the CUDA check, after both kernel lookups)."""
    q = torch.randn(8, 4, 8, dtype=torch.bfloat16)
    k = v = torch.randn(8, 2, 8, dtype=torch.bfloat16)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(packed_attention)(q, k, v, cu, 5, scale=0.35)
    # an import attempt is listed as a break reason (dynamo counts no break when nothing
    # after it runs on the CPU, so the count alone would not show it)
    assert explanation.break_reasons == [] and explanation.graph_count == 1
