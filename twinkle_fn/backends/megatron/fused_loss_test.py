"""The fused loss against megatron's vocab-parallel path (`train.token_losses`): the output
processor on its own (padded vocabulary, tied weight, [s, b] layout, float32 / float64) and a
whole tiny model's loss, log-probabilities and gradients through the backend, fusion on vs off.

Tolerances. float32: both paths sum the same float32 terms in another order (chunks vs one
reduction): 1e-5 relative (observed ~1e-7). float64: the fused path runs in float64 but
megatron's cross entropy upcasts to float32 only, so the two agree to float32 rounding (1e-5);
the fused path alone matches a float64 reference to 1e-10. bf16 on CUDA (the Triton kernel):
both paths get the same bf16 logits and round the logits gradient to bf16 once; the float32
softmax sums differ in order only: 1e-4 on losses, 2e-2 relative on gradients (a bf16 ulp is
4e-3, and a gradient element sums many rounded terms).
"""

import pytest
import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer import TransformerConfig

import twinkle_fn as tf
from twinkle_fn.backends.megatron import train
from twinkle_fn.backends.megatron.fused_loss import (
    FusedLoss,
    fused_loss_applies,
    fused_token_losses,
)
from twinkle_fn.backends.megatron.train import token_losses
from twinkle_fn.data import pack, pad_collate
from twinkle_fn.testing import random_features, tiny_config

VOCAB, PADDED, HIDDEN, SEQ, BATCH = 10, 16, 8, 5, 3


def _config(dtype=torch.float32, **fields):
    return TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=1,
        params_dtype=dtype,
        use_cpu_initialization=True,
        **fields,
    )


def _output_layer(config, *, tied=False):
    layer = tensor_parallel.ColumnParallelLinear(
        HIDDEN,
        PADDED,
        config=config,
        init_method=torch.nn.init.normal_,
        bias=False,
        skip_bias_add=False,
        gather_output=False,
        skip_weight_param_allocation=tied,
    )
    return layer.to("cuda" if torch.cuda.is_available() else "cpu")


def _inputs(dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels[0, 1] = labels[2, 4] = -100
    labels[1] = -100  # a row with nothing supervised
    return hidden.to(device, dtype).requires_grad_(), labels.to(device)


def _weight(layer, dtype, tied, seed=1):
    """The output weight, its padding rows huge: unmasked they would take all the softmax mass."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(PADDED, HIDDEN, generator=gen, dtype=torch.float64)
    w[VOCAB:] = 50.0
    w = w.to(_device(), dtype)
    if tied:
        return torch.nn.Parameter(w)
    with torch.no_grad():
        layer.weight.copy_(w)
    return None


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _run(fn, layer, output_weight, hidden, labels):
    """(loss sum, per-token losses [b, s], grad of hidden, grad of the output weight)."""
    out = fn(
        hidden_states=hidden,
        output_layer=layer,
        output_weight=output_weight,
        labels=labels,
        context=VOCAB,
        chunk_size=4,
    )
    if isinstance(out, FusedLoss):
        loss_sum, per_token = out
    else:
        per_token = torch.where(labels != -100, out, 0.0)
        loss_sum = per_token.sum()
    weight = layer.weight if output_weight is None else output_weight
    grad_h, grad_w = torch.autograd.grad(loss_sum, (hidden, weight))
    return loss_sum.detach(), per_token.detach(), grad_h, grad_w


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fused_loss_equals_the_vocab_parallel_path(megatron_world, tied):
    layer = _output_layer(_config(), tied=tied)
    output_weight = _weight(layer, torch.float32, tied)
    hidden, labels = _inputs(torch.float32, _device())
    fused = _run(fused_token_losses, layer, output_weight, hidden, labels)
    want = _run(token_losses, layer, output_weight, hidden, labels)
    for got, ref in zip(fused, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert fused[1].shape == (BATCH, SEQ)
    assert (fused[1][labels == -100] == 0).all()
    assert (fused[3][VOCAB:] == 0).all()  # padding rows: no softmax mass, no gradient


@pytest.mark.skipif(torch.cuda.is_available(), reason="float64 reference: CPU torch path")
def test_fused_loss_in_float64_matches_a_float64_reference(megatron_world):
    layer = _output_layer(_config(torch.float64))
    _weight(layer, torch.float64, tied=False)
    hidden, labels = _inputs(torch.float64, "cpu")
    loss_sum, per_token, grad_h, grad_w = _run(fused_token_losses, layer, None, hidden, labels)
    assert loss_sum.dtype == torch.float64
    h = hidden.detach().requires_grad_()
    w = layer.weight.detach().clone().requires_grad_()
    logits = (h @ w[:VOCAB].t()).transpose(0, 1)  # [b, s, vocab]
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    want.sum().backward()
    torch.testing.assert_close(per_token, want.detach().view(BATCH, SEQ), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(loss_sum, want.sum().detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad_h, h.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad_w, w.grad, rtol=1e-10, atol=1e-10)
    # megatron's path upcasts to float32 only
    got = _run(token_losses, layer, None, hidden, labels)
    torch.testing.assert_close(got[0].double(), loss_sum, rtol=1e-5, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton cross entropy kernel: CUDA")
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fused_loss_in_bf16_on_cuda_equals_the_vocab_parallel_path(megatron_world, tied):
    layer = _output_layer(_config(torch.bfloat16), tied=tied)
    output_weight = _weight(layer, torch.bfloat16, tied)
    hidden, labels = _inputs(torch.bfloat16, "cuda")
    fused = _run(fused_token_losses, layer, output_weight, hidden, labels)
    want = _run(token_losses, layer, output_weight, hidden, labels)
    torch.testing.assert_close(fused[0], want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fused[1], want[1], rtol=1e-4, atol=1e-4)
    for got, ref in zip(fused[2:], want[2:], strict=True):
        assert (got.float() - ref.float()).norm() <= 2e-2 * ref.float().norm()


def test_without_grad_mode_no_gradient_is_taken(megatron_world):
    layer = _output_layer(_config())
    _weight(layer, torch.float32, tied=False)
    hidden, labels = _inputs(torch.float32, _device())
    with torch.no_grad():
        out = fused_token_losses(
            hidden_states=hidden,
            output_layer=layer,
            output_weight=None,
            labels=labels,
            context=VOCAB,
        )
    assert not out.loss_sum.requires_grad
    want = _run(token_losses, layer, None, hidden, labels)
    torch.testing.assert_close(out.loss_sum, want[0], rtol=1e-5, atol=1e-5)


def test_fused_loss_applies_to_megatrons_bias_free_output_layer_only(megatron_world):
    config = _config()
    layer = _output_layer(config)
    hidden = torch.zeros(SEQ, BATCH, HIDDEN)
    assert fused_loss_applies(config, layer, hidden)
    assert not fused_loss_applies(config, torch.nn.Linear(HIDDEN, PADDED, bias=False), hidden)
    biased = tensor_parallel.ColumnParallelLinear(
        HIDDEN, PADDED, config=config, init_method=torch.nn.init.zeros_, bias=True
    )
    assert not fused_loss_applies(config, biased, hidden)


def test_a_vocabulary_larger_than_the_output_layer_is_refused(megatron_world):
    layer = _output_layer(_config())
    hidden, labels = _inputs(torch.float32, _device())
    with pytest.raises(ValueError, match="exceeds the output layer's 16 rows"):
        fused_token_losses(
            hidden_states=hidden,
            output_layer=layer,
            output_weight=None,
            labels=labels,
            context=PADDED + 1,
        )


def _fwd_bwd(hf_config, layout):
    """Loss sum, per-token log-probs and gradients of one `tf.fwd_bwd` on the megatron backend."""
    model = tf.models.from_hf_config(
        hf_config, seed=0, backend="megatron", options={"num_micro_batches": 2}
    )
    state = tf.init(model, tf.optim.adamw(1e-3))
    feats = random_features(6, seed=3)
    batch = pack(feats) if layout == "packed" else pad_collate(feats, pad_token_id=0)
    grads, aux = tf.fwd_bwd(state, batch)
    params = {n: g.detach().cpu().clone() for n, g in grads.params.items()}
    return float(aux["loss_sum"]), aux["logps"].cpu(), params


@pytest.mark.parametrize(
    ("tied", "layout"), [(False, "packed"), (True, "padded")], ids=["untied-packed", "tied-padded"]
)
def test_a_models_loss_logps_and_gradients_do_not_change_with_the_fusion(
    megatron_world, monkeypatch, tied, layout
):
    """A 96-token vocabulary padded to 128 rows; two micro-batches each."""
    calls = []

    def counted(**kwargs):
        calls.append(kwargs["labels"].shape)
        return fused_token_losses(**kwargs)

    monkeypatch.setattr(train, "fused_token_losses", counted)
    hf_config = tiny_config("qwen2", tie_word_embeddings=tied)
    fused = _fwd_bwd(hf_config, layout)
    assert len(calls) == 2  # one per micro-batch
    monkeypatch.setattr(train, "fused_loss_applies", lambda *args: False)
    plain = _fwd_bwd(hf_config, layout)
    assert len(calls) == 2
    assert fused[0] == pytest.approx(plain[0], rel=1e-5)
    torch.testing.assert_close(fused[1], plain[1], rtol=1e-5, atol=1e-5)
    assert fused[2].keys() == plain[2].keys()
    for name, grad in fused[2].items():
        torch.testing.assert_close(grad, plain[2][name], rtol=1e-4, atol=1e-6, msg=name)
    output = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
    assert fused[2][output].abs().sum() > 0
