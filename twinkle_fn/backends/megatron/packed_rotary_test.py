import dataclasses

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import attention as mcore_attention
from transformers import AutoModelForCausalLM

from twinkle_fn.backends.megatron import attention
from twinkle_fn.backends.megatron.attention_test import DIM, HEADS, _config
from twinkle_fn.backends.megatron.bridge import hf_to_mcore
from twinkle_fn.backends.megatron.model import build_gpt_model
from twinkle_fn.backends.megatron.packed_rotary import (
    RotaryPackedSeqParams,
    rotary_freqs,
    rotate,
    with_rotary,
)
from twinkle_fn.mesh import Mesh
from twinkle_fn.testing import tiny_config

LENS = [5, 3, 7, 1]  # one packed row of four samples, 16 tokens


def _params(lens=LENS) -> PackedSeqParams:
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    longest = max(lens)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def _positions(lens=LENS) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lens])[None]  # [1, tokens]


def _model(family="qwen3", **extra):
    cfg = tiny_config(family, **extra)
    torch.manual_seed(1)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model = build_gpt_model(cfg, Mesh())
    local = hf_to_mcore(dict(hf.state_dict()), cfg, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    model.load_state_dict(local, strict=False)
    return cfg, model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot_dim", [DIM, DIM // 2])
def test_rotate_is_megatrons_per_sample_rotation_bit_for_bit(megatron_world, dtype, rot_dim):
    params = _params()
    # a table laid out as megatron's: positions 0..longest-1, [longest, 1, 1, rot_dim]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    angles = torch.outer(torch.arange(max(LENS), dtype=torch.float32), inv_freq)
    table = torch.cat((angles, angles), dim=-1)[:, None, None, :]
    t = torch.randn(sum(LENS), HEADS, DIM, generator=torch.Generator().manual_seed(0)).to(dtype)
    want = apply_rotary_pos_emb(t, table, _config(), cu_seqlens=params.cu_seqlens_q)
    got = rotate(t, table[_positions().reshape(-1)])
    assert got.dtype == dtype
    assert torch.equal(got, want)
    if rot_dim < DIM:  # the channels past rot_dim pass through
        assert torch.equal(got[..., rot_dim:], t[..., rot_dim:])


def test_with_rotary_gathers_the_models_own_angles_per_token(megatron_world):
    _, model = _model()
    params = _params()
    out = with_rotary(params, model, _positions())
    assert isinstance(out, RotaryPackedSeqParams)
    for f in dataclasses.fields(PackedSeqParams):
        assert getattr(out, f.name) is getattr(params, f.name)
    table = model.rotary_pos_emb(max(LENS), packed_seq=True)
    assert rotary_freqs(out).shape == (sum(LENS), 1, 1, table.shape[-1])
    starts = [0, 5, 8, 15]  # every sample restarts at position 0
    for s in starts:
        assert torch.equal(rotary_freqs(out)[s], table[0])
    assert torch.equal(rotary_freqs(out)[14], table[6])  # 7th token of the third sample


def test_with_rotary_leaves_rows_megatron_must_rotate(megatron_world):
    _, model = _model()
    padded = PackedSeqParams(qkv_format="sbhd")
    assert with_rotary(padded, model, _positions()) is padded
    model.rotary_pos_emb.rotary_interleaved = True  # a layout `rotate` does not compute
    params = _params()
    assert with_rotary(params, model, _positions()) is params
    assert rotary_freqs(params) is None and rotary_freqs(None) is None


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_a_packed_row_rotated_per_token_trains_exactly_as_megatrons_per_sample_path(
    megatron_world, monkeypatch, family
):
    """Logits and every gradient are bit-identical, and megatron's THD rotation (which reads
    the boundaries on the host in every layer) never runs."""
    cfg, model = _model(family)
    ids = torch.randint(
        0, cfg.vocab_size, (1, sum(LENS)), generator=torch.Generator().manual_seed(3)
    )
    calls = []
    mcore_rotate = mcore_attention.apply_rotary_pos_emb

    def counted(*args, **kwargs):
        calls.append(kwargs.get("cu_seqlens"))
        return mcore_rotate(*args, **kwargs)

    monkeypatch.setattr(mcore_attention, "apply_rotary_pos_emb", counted)

    def run(params):
        model.zero_grad(set_to_none=True)
        logits = model(ids, _positions(), None, packed_seq_params=params)
        (logits.float().square().mean()).backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want_logits, want_grads = run(_params())
    assert len(calls) == 2 * cfg.num_hidden_layers  # queries and keys of every layer
    calls.clear()
    logits, grads = run(with_rotary(_params(), model, _positions()))
    assert calls == []
    assert torch.equal(logits, want_logits)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, want_grads[name]), name


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_a_decoder_layer_compiles_into_one_graph(megatron_world, monkeypatch, layout):
    """What `compile_layers` traces: no graph break in the layer (a break inside the core
    attention also split megatron's ``with`` around it). The varlen kernel, CUDA-only, is
    stood in for by a function of the same shapes, as the GPU path calls it."""
    cfg, model = _model()
    monkeypatch.setattr(attention, "packed_attention", lambda q, k, v, cu, n, **kw: q * 1.0)
    if layout == "packed":
        hidden = torch.randn(sum(LENS), 1, cfg.hidden_size)
        kwargs = {"packed_seq_params": with_rotary(_params(), model, _positions())}
    else:
        hidden = torch.randn(6, 2, cfg.hidden_size)  # [seq, batch, hidden]
        kwargs = {"rotary_pos_emb": model.rotary_pos_emb(6)}
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model.decoder.layers[0])(
        hidden, attention_mask=None, **kwargs
    )
    assert explanation.break_reasons == [] and explanation.graph_count == 1
