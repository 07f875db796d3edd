"""twinkle_fn/backends/transformers/attention.py: packed rows through the varlen path, the rest as SDPA."""

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

import twinkle_fn as tf
from twinkle_fn.backends.transformers import attention
from twinkle_fn.backends.transformers.compute import model_inputs
from twinkle_fn.data import pack
from twinkle_fn.models import families
from twinkle_fn.models.families import FAMILIES
from twinkle_fn.testing import random_features, tiny_config

CPU = torch.device("cpu")
LENGTHS = (5, 9, 7)
# The families whose packed rows the transformers backend trains (`Family.packed_rows`).
PACKABLE = tuple(f for f in FAMILIES if families.family(f).packed_rows is None)


def _module(family: str, device: torch.device, **overrides) -> torch.nn.Module:
    config = tiny_config(family, vocab_size=64, **overrides)
    module = tf.models.from_hf_config(config, seed=0, device=device).module.eval()
    assert attention.use_varlen_attention(module)
    return module


def _features() -> list[dict]:
    feats = random_features(len(LENGTHS), vocab_size=64, min_len=9, max_len=9, seed=1)
    return [{k: v[:n] for k, v in f.items()} for f, n in zip(feats, LENGTHS, strict=True)]


def _packed_vs_alone(module: torch.nn.Module, device: torch.device) -> None:
    """The packed row's logits against each sample run alone (plain causal SDPA)."""
    feats = _features()
    batch = pack(feats)
    config = module.config
    with torch.no_grad():
        packed = module(**model_inputs(batch, device, config), use_cache=False).logits[0]
        start = 0
        for f, n in zip(feats, LENGTHS, strict=True):
            ids = torch.tensor([f["input_ids"]], device=device)
            alone = module(input_ids=ids, use_cache=False).logits[0]
            # float32 on CPU: the same math in another order; bf16 on CUDA (8 mantissa bits)
            tol = 1e-5 if alone.dtype == torch.float32 else 6e-2
            torch.testing.assert_close(packed[start : start + n], alone, rtol=0, atol=tol)
            start += n


def test_use_varlen_attention_switches_sdpa_models_only():
    module = _module("qwen2", CPU)
    assert module.config._attn_implementation == attention.NAME
    eager = AutoModelForCausalLM.from_config(tiny_config("qwen2"), attn_implementation="eager")
    assert not attention.use_varlen_attention(eager)
    assert eager.config._attn_implementation == "eager"


@pytest.mark.parametrize("family", PACKABLE)
def test_a_packed_row_attends_within_each_sample_on_cpu(family):
    """On a CPU the packed row takes SDPA under the block mask built from cu_seqlens."""
    _packed_vs_alone(_module(family, CPU), CPU)


def test_a_packed_row_of_a_family_that_cannot_keep_samples_apart_is_refused():
    """A row with a `Family.packed_rows` reason (here qwen2's, given one) is refused with it."""
    family = "qwen2"
    row = dataclasses.replace(families.family(family), packed_rows="its samples would mix")
    config = _module(family, CPU).config
    refused = pytest.raises(ValueError, match=f"packed rows .* model family '{family}'")
    with families.registered(row), refused as err:
        model_inputs(pack(_features()), CPU, config)
    assert row.packed_rows in str(err.value)


def test_a_sliding_window_holds_in_a_packed_row():
    module = _module("mistral", CPU, sliding_window=3)
    _packed_vs_alone(module, CPU)


def test_packed_inputs_carry_the_boundaries_and_no_host_mask():
    batch = pack(_features())
    qwen = model_inputs(batch, CPU, _module("qwen2", CPU).config)
    assert torch.equal(qwen["cu_seq_lens_q"], batch["cu_seqlens"])
    assert qwen["cu_seq_lens_q"].dtype == torch.int32
    assert qwen["max_length_q"] == qwen["max_length_k"] == max(LENGTHS)
    assert qwen["attention_mask"] == {"full_attention": None}
    llama = model_inputs(batch, CPU, _module("llama", CPU).config)
    assert llama["attention_mask"].shape == (1, 1, sum(LENGTHS), sum(LENGTHS))
    kept_on_sdpa = model_inputs(batch, CPU, tiny_config("llama"))
    assert "cu_seq_lens_q" not in kept_on_sdpa


def test_packed_kwargs_read_the_longest_sample_from_cu_seqlens():
    cu = torch.tensor([0, 4, 11, 13])
    kwargs = attention.packed_kwargs(cu, None, CPU)
    assert kwargs["max_length_q"] == 7 and kwargs["cu_seq_lens_k"].dtype == torch.int32


def test_a_packed_batch_of_two_rows_is_refused():
    q = torch.zeros(2, 4, 6, 8)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="one row"):
        attention.attention_forward(None, q, q, q, None, cu_seq_lens_q=cu, max_length_q=6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the varlen kernel needs CUDA")
@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3_5_text"])
def test_a_packed_row_runs_the_varlen_kernel_on_cuda(family, monkeypatch):
    """bf16 on CUDA: the varlen kernel runs (no SDPA fallback) and the packed row's logits
    match each sample run alone."""
    module = _module(family, torch.device("cuda")).bfloat16()
    ran = []
    monkeypatch.setattr(attention, "block_causal_mask", lambda *a: ran.append("fallback") or None)
    _packed_vs_alone(module, torch.device("cuda"))
    assert not ran
