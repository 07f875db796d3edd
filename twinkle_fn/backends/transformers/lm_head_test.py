import pytest
import torch
from transformers import AutoModelForCausalLM

from twinkle_fn.backends.transformers.lm_head import (
    FusedLMHead,
    fuse_lm_head,
    loss_mode,
    terms_mode,
)
from twinkle_fn.losses import LossOutput, cross_entropy_sum, token_entropy, token_logps
from twinkle_fn.models import from_hf_config
from twinkle_fn.testing import tiny_config


@pytest.mark.parametrize("tied", [False, True])
def test_head_is_a_linear_until_loss_mode(tied):
    module = from_hf_config(tiny_config(tie_word_embeddings=tied), seed=0).module
    head = module.get_output_embeddings()
    assert isinstance(head, FusedLMHead) and isinstance(head, torch.nn.Linear)
    assert (head.weight is module.get_input_embeddings().weight) == tied
    ids = torch.randint(0, 96, (2, 6))
    labels = torch.randint(0, 96, (2, 6))
    labels[0, :2] = -100
    logits = module(input_ids=ids).logits
    assert logits.shape == (2, 6, 96)
    with loss_mode(head, labels):
        loss_sum = module(input_ids=ids).logits
    torch.testing.assert_close(loss_sum, cross_entropy_sum(logits, labels).loss_sum)
    assert head._labels is None


@pytest.mark.parametrize("with_entropy", [False, True])
def test_terms_mode_gives_each_tokens_logp_and_entropy_of_the_logits(with_entropy):
    """float32 model, chunked vs whole-vocabulary log-softmax over 96 logits in another order:
    terms of magnitude ~5 (float32 eps 1.2e-7, a few roundings) to 1e-5, and the gradients
    reaching the model's weights to 1e-5."""
    module = from_hf_config(tiny_config(tie_word_embeddings=True), seed=0).module
    head = module.get_output_embeddings()
    ids = torch.randint(0, 96, (2, 6))
    labels = torch.randint(0, 96, (2, 6))
    labels[1, 3:] = -100
    logits = module(input_ids=ids).logits / 0.8
    want = token_logps(logits, labels) + (token_entropy(logits, labels) if with_entropy else 0)
    want_grads = torch.autograd.grad(want.sum(), list(module.parameters()))
    with terms_mode(head, labels, temperature=0.8, with_entropy=with_entropy):
        terms = module(input_ids=ids).logits
    assert terms.shape == (2, 6, 2) and head._terms is None and head._labels is None
    if not with_entropy:
        assert (terms[..., 1] == 0).all()
    got = terms[..., 0] + terms[..., 1]
    got_grads = torch.autograd.grad(got.sum(), list(module.parameters()))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fuse_refuses_a_non_linear_head():
    module = from_hf_config(tiny_config(), seed=0).module
    module.lm_head = torch.nn.Sequential(torch.nn.Linear(32, 96))
    with pytest.raises(TypeError, match="Sequential"):
        fuse_lm_head(module)


def test_under_autocast_the_head_projects_in_the_autocast_dtype(monkeypatch):
    import twinkle_fn.backends.transformers.lm_head as lm_head

    seen = {}

    def spy(hidden, weight, labels, bias=None, supervised_rows=None):
        seen["dtypes"] = (hidden.dtype, weight.dtype)
        seen["rows"] = supervised_rows
        return LossOutput(hidden.float().sum(), labels.numel())

    monkeypatch.setattr(lm_head, "fused_linear_cross_entropy_sum", spy)
    head = FusedLMHead(8, 5)
    rows = torch.arange(6)
    labels = torch.zeros(2, 3).long()
    with torch.autocast("cpu", dtype=torch.bfloat16), loss_mode(head, labels, rows):
        head(torch.randn(2, 3, 8))
    assert seen["dtypes"] == (torch.bfloat16, torch.bfloat16)
    assert seen["rows"] is rows  # loss_mode's precomputed rows reach the fused loss
    assert head._rows is None and head._labels is None


def test_capped_logits_are_refused():
    module = AutoModelForCausalLM.from_config(
        tiny_config("gemma3_text", final_logit_softcapping=30.0)
    )
    with pytest.raises(ValueError, match=r"final_logit_softcapping=30\.0 is not supported"):
        fuse_lm_head(module)
