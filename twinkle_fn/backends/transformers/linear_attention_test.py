"""twinkle_fn/backends/transformers/linear_attention.py: a packed row through Qwen3.5's Gated
DeltaNet layers gives each sample what it gives alone."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

import twinkle_fn as tf
from twinkle_fn.backends.transformers import attention, linear_attention
from twinkle_fn.backends.transformers.compute import model_inputs
from twinkle_fn.backends.transformers.linear_attention import (
    PackedRows,
    keep_samples_apart,
    varlen_kernels,
)
from twinkle_fn.data import pack, pad_collate
from twinkle_fn.testing import random_features, tiny_config

CPU = torch.device("cpu")
FAMILY = "qwen3_5_text"
# shorter than the convolution (4 taps), two chunks of the recurrence (64), and plain ones
LENGTHS = (2, 70, 9, 5)


def _features() -> list[dict]:
    """Samples of `LENGTHS` tokens, every next token supervised (so each trains alone too)."""
    feats = random_features(len(LENGTHS), vocab_size=64, min_len=70, max_len=70, seed=2)
    ids = [f["input_ids"][:n] for f, n in zip(feats, LENGTHS, strict=True)]
    return [{"input_ids": x, "labels": [*x[1:], -100]} for x in ids]


def _float64_state() -> tf.TrainState:
    model = tf.models.from_hf_config(tiny_config(FAMILY, vocab_size=64), seed=0, device="cpu")
    model.module.to(torch.float64)
    return tf.init(model, tf.optim.adamw(1e-3))


def test_the_deltanet_layers_are_adapted_in_place_and_nothing_else():
    module = tf.models.from_hf_config(tiny_config(FAMILY), seed=0).module
    names = [n for n, _ in module.named_parameters()]
    # from_hf_config adopted it already: adapting again changes nothing
    assert keep_samples_apart(module) == 1
    mixers = [m for m in module.modules() if isinstance(m, PackedRows)]
    assert len(mixers) == 1 and mixers[0] is module.model.layers[0].linear_attn
    assert type(mixers[0]).__name__ == "PackedQwen3_5GatedDeltaNet"
    assert [n for n, _ in module.named_parameters()] == names
    assert keep_samples_apart(AutoModelForCausalLM.from_config(tiny_config("qwen2"))) == 0


def test_a_packed_row_gives_each_sample_its_logits_and_gradients_alone_in_float64():
    """float64 on the torch path: each sample's logits in the packed row equal it run alone,
    and the packed row's gradients equal the sum of the samples' alone. The same sums in
    another order (the projections see T rows instead of n), so 1e-10; except the weights of
    transformers' Qwen3.5 RMSNorms, which normalise in float32 (``x.float()``) whatever the
    model's dtype: their gradient is a float32 sum over the row's tokens, so it matches the
    per-sample sums to float32 rounding (1e-6 of its largest element; observed 1.3e-7)."""
    feats = _features()
    state = _float64_state()
    module = state.model.module
    packed_batch = pack(feats)
    with torch.no_grad():
        inputs = model_inputs(packed_batch, CPU, module.config)
        packed = module(**inputs, use_cache=False).logits[0]  # [T, vocab]
        whole = module(input_ids=packed_batch["input_ids"], use_cache=False).logits[0]
    start = 0
    for f, n in zip(feats, LENGTHS, strict=True):
        with torch.no_grad():
            ids = torch.tensor([f["input_ids"]])
            alone = module(input_ids=ids, use_cache=False).logits[0]
        torch.testing.assert_close(packed[start : start + n], alone, rtol=0, atol=1e-10)
        if start:  # read as one sequence, a later sample sees the earlier ones
            assert (whole[start : start + n] - alone).abs().max() > 1e-3
        start += n
    grads, aux = tf.fwd_bwd(state, packed_batch, donate=False)
    acc = None
    for f in feats:
        acc, _ = tf.fwd_bwd(state, pad_collate([f], pad_token_id=0), acc, donate=False)
    torch.testing.assert_close(aux["loss_sum"], acc.loss_sum, rtol=1e-10, atol=0)
    assert grads.params.keys() == acc.params.keys()
    float32_norms = {
        f"{owner}.weight" for owner, m in module.named_modules() if isinstance(m, Qwen3_5RMSNorm)
    }
    assert float32_norms and float32_norms <= grads.params.keys()
    for name, grad in grads.params.items():
        scale = float(grad.abs().max())
        assert scale > 0, name
        atol = 1e-6 * scale if name in float32_norms else 1e-10
        torch.testing.assert_close(grad, acc.params[name], rtol=0, atol=atol, msg=name)


def test_a_decoder_off_the_varlen_attention_still_hands_the_deltanet_its_boundaries():
    """On transformers' own SDPA (before `attention.use_varlen_attention`) a packed row takes
    the block mask, and the DeltaNet layers the boundaries: each sample as alone (float32:
    the same math in another order, 1e-5)."""
    module = tf.models.from_hf_config(tiny_config(FAMILY, vocab_size=64), seed=0).module.eval()
    assert module.config._attn_implementation == "sdpa"
    feats = _features()
    inputs = model_inputs(pack(feats), CPU, module.config)
    assert inputs["attention_mask"].shape == (1, 1, sum(LENGTHS), sum(LENGTHS))
    assert inputs["cu_seq_lens_q"].tolist() == [0, 2, 72, 81, 86]
    with torch.no_grad():
        packed = module(**inputs, use_cache=False).logits[0]
        start = 0
        for f, n in zip(feats, LENGTHS, strict=True):
            alone = module(input_ids=torch.tensor([f["input_ids"]]), use_cache=False).logits[0]
            torch.testing.assert_close(packed[start : start + n], alone, rtol=0, atol=1e-5)
            start += n


def test_bad_packed_calls_are_refused_before_any_compute():
    mixer = tf.models.from_hf_config(tiny_config(FAMILY), seed=0).module.model.layers[0]
    mixer = mixer.linear_attn
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="one row of samples, got 2 rows"):
        mixer(torch.zeros(2, 6, 32), cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match="without a cache"):
        mixer(torch.zeros(1, 6, 32), cache=object(), cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match="ends at 6 but the packed row has 7 tokens"):
        mixer(torch.zeros(1, 7, 32), cu_seq_lens_q=cu)


def test_the_sample_index_of_every_token():
    cu = torch.tensor([0, 2, 2, 5, 6], dtype=torch.int32)
    got = linear_attention._sample_index(cu, 6)
    assert got.dtype == torch.int32 and got.tolist() == [[0, 0, 2, 2, 2, 3]]


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or not varlen_kernels(),
    reason="fla's and causal-conv1d's varlen kernels need CUDA and the packages",
)
def test_a_packed_row_runs_the_varlen_kernels_once_per_layer_on_cuda(monkeypatch):
    """bf16 on CUDA with fla and causal-conv1d: the DeltaNet runs once on the whole row (no
    per-sample slices) and each sample's logits match it alone (bf16: 8 mantissa bits)."""
    cuda = torch.device("cuda")
    module = tf.models.from_hf_config(tiny_config(FAMILY, vocab_size=64), seed=0, device=cuda)
    module = module.module.eval().bfloat16()
    assert attention.use_varlen_attention(module)
    lengths = []
    base = type(module.model.layers[0].linear_attn).__mro__[2]
    real = base.forward

    def counted(self, hidden_states, *args, **kwargs):
        lengths.append(hidden_states.shape[1])
        return real(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(base, "forward", counted)
    feats = _features()
    with torch.no_grad():
        packed = module(**model_inputs(pack(feats), cuda, module.config), use_cache=False)
        assert lengths == [sum(LENGTHS)]
        start = 0
        for f, n in zip(feats, LENGTHS, strict=True):
            ids = torch.tensor([f["input_ids"]], device=cuda)
            alone = module(input_ids=ids, use_cache=False).logits[0]
            torch.testing.assert_close(
                packed.logits[0, start : start + n], alone, rtol=0, atol=6e-2
            )
            start += n
