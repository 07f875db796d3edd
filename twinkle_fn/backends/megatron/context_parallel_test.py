"""Context parallelism: the zigzag batch split (pure), and `SDPAAttention` over two real gloo
ranks against full-sequence attention on one.

Tolerance: float64 throughout (gloo gathers and reduce-scatters float64 exactly); the chunked
attention sums the same terms as the full one in another order, so outputs and gradients of
q, k and v agree to 1e-12 absolute (observed ~1e-16).
"""

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType

from twinkle_fn.backends.megatron.attention_test import DIM, GROUPS, HEADS
from twinkle_fn.backends.megatron.attention_test import _config as attention_config
from twinkle_fn.backends.megatron.context_parallel import (
    global_order,
    sequence_multiple,
    split_packed,
    split_sequence,
)
from twinkle_fn.testing_dist import spawn

TOL = dict(rtol=0, atol=1e-12)


def test_each_rank_holds_chunks_r_and_2cp_minus_1_minus_r():
    seq = torch.arange(16)[None]  # [batch, seq]
    assert split_sequence(seq, 2, 0).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert split_sequence(seq, 2, 1).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert torch.equal(split_sequence(seq, 1, 0), seq)
    # Packed: every sample is cut on its own, sample after sample.
    packed = split_packed(torch.arange(12)[None], [0, 8, 12], 2, 1)
    assert packed.tolist() == [[2, 3, 4, 5, 9, 10]]


@pytest.mark.parametrize("cp", [2, 3])
def test_gathered_chunks_go_back_to_sequence_order(cp):
    bounds = [0, 6 * cp, 6 * cp, 10 * cp]  # an empty sample too
    seq = torch.arange(bounds[-1])
    gathered = torch.cat([split_packed(seq, bounds, cp, r, dim=0) for r in range(cp)])
    assert torch.equal(global_order(gathered, bounds, cp), seq)


def test_sequence_multiple_fits_2cp_chunks_and_the_local_multiple():
    assert sequence_multiple(1, 3) == 3
    assert sequence_multiple(2) == 4
    assert sequence_multiple(2, 2) == 4  # each rank's 2 chunks: an even length
    assert sequence_multiple(2, 4) == 8
    assert sequence_multiple(3, 2) == 6


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: split_sequence(torch.zeros(1, 6), 2, 0), "multiple of 4"),
        (lambda: split_packed(torch.zeros(1, 8), [0, 4, 7], 2, 0), "global length 8"),
        (lambda: split_sequence(torch.zeros(1, 8), 2, 2), "cp_rank < cp_size"),
        (lambda: sequence_multiple(0), "cp_size >= 1"),
        (lambda: sequence_multiple(2, 0), "local_multiple must be a positive int"),
    ],
)
def test_sequences_that_do_not_split_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _config(cp, **overrides):
    return attention_config(context_parallel_size=cp, **overrides)


def _run(cp_size, rank, mask_type, window, bounds, seed):
    """Output and q/k/v gradients on this rank's chunks and on the whole sequence."""
    from twinkle_fn.backends.megatron.attention import SDPAAttention

    total, batch = bounds[-1], 1 if len(bounds) > 2 else 2
    g = torch.Generator().manual_seed(seed)
    full = [
        torch.randn(total, batch, n, DIM, generator=g, dtype=torch.float64)
        for n in (HEADS, GROUPS, GROUPS)
    ]
    weight = torch.randn(total, batch, HEADS * DIM, generator=g, dtype=torch.float64)

    def local(t):
        return split_packed(t, bounds, cp_size, rank, dim=0)

    def grads(cp, tensors, w):
        attn = SDPAAttention(_config(cp, window_size=window), 1, mask_type, "self").eval()
        tensors = [t.clone().requires_grad_() for t in tensors]
        params = None
        if len(bounds) > 2:  # packed: THD [tokens, n, dim]
            cu = torch.tensor(bounds, dtype=torch.int32)
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
            tensors_in, w = [t[:, 0] for t in tensors], w[:, 0]
        else:
            tensors_in = tensors
        out = attn(*tensors_in, None, packed_seq_params=params)
        (out * w).sum().backward()
        return out.detach(), [t.grad for t in tensors]

    out, got = grads(cp_size, [local(t) for t in full], local(weight))
    ref_out, ref = grads(1, full, weight)
    if len(bounds) > 2:
        ref_out = ref_out[:, None]
        out = out[:, None]
    return (out, local(ref_out)), [(a, local(b)) for a, b in zip(got, ref, strict=True)]


def _cases():
    from twinkle_fn.backends.megatron import parallel
    from twinkle_fn.mesh import Mesh

    parallel.initialize(Mesh(cp=2))
    rank = torch.distributed.get_rank()
    try:
        return {
            "causal": _run(2, rank, AttnMaskType.causal, None, [0, 12], 0),
            "window": _run(2, rank, AttnMaskType.causal, (3, 0), [0, 16], 1),
            "no_mask": _run(2, rank, AttnMaskType.no_mask, None, [0, 8], 2),
            "packed": _run(2, rank, AttnMaskType.causal, None, [0, 8, 12, 20], 3),
        }
    finally:
        parallel.destroy()


@pytest.fixture(scope="module")
def two_ranks():
    return spawn(_cases, 2)


@pytest.mark.parametrize("case", ["causal", "window", "no_mask", "packed"])
def test_cp_attention_and_its_gradients_match_the_whole_sequence(two_ranks, case):
    for results in two_ranks:
        (out, want), grads = results[case]
        torch.testing.assert_close(out, want, **TOL)
        for name, (got, ref) in zip("qkv", grads, strict=True):
            torch.testing.assert_close(got, ref, **TOL, msg=lambda m, n=name: f"d{n}: {m}")
