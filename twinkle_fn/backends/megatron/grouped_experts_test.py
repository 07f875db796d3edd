"""`GroupedSequentialMLP` equals megatron's ``SequentialMLP`` on the same weights: outputs, the
input gradient and every expert's weight gradients, with uneven and zero token counts."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.experts import SequentialMLP

from twinkle_fn.backends.megatron.grouped_experts import (
    GroupedSequentialMLP,
    grouped_linear,
    grouped_supported,
)

# Token counts per local expert: uneven, with experts that get none (first, middle, last).
COUNTS = [0, 5, 1, 0, 9, 3, 0]


def _config(hidden: int, ffn: int, **kw) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=2,
        ffn_hidden_size=ffn,
        moe_ffn_hidden_size=ffn,
        num_moe_experts=len(COUNTS),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        use_cpu_initialization=True,
        **kw,
    )


def _pair(config: TransformerConfig) -> tuple[SequentialMLP, GroupedSequentialMLP]:
    submodules = LocalSpecProvider().grouped_mlp_modules(False).keywords["submodules"]
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    ref = SequentialMLP(len(COUNTS), config, submodules, pg_collection=pgs)
    grouped = GroupedSequentialMLP(len(COUNTS), config, submodules, pg_collection=pgs)
    grouped.load_state_dict(ref.state_dict())
    return ref, grouped


def _run(mlp, x, counts, probs):
    x = x.clone().requires_grad_()
    out, bias = mlp(x, counts, probs)
    assert bias is None
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = {n: p.grad for n, p in mlp.named_parameters()}
    return out, x.grad, grads


@pytest.mark.parametrize(
    ("hidden", "ffn"),
    # 16 x 8 float32: strides of 16-byte multiples, torch's grouped GEMM kernel on CPU;
    # 12 x 6: fc2's rows of 6 floats (24 bytes) are not, the per-expert loop there.
    [(16, 8), (12, 6)],
)
def test_grouped_experts_equal_sequential_mlp(megatron_world, hidden, ffn):
    """float32: the same products, summed in another order by the grouped kernel: 1e-5."""
    torch.manual_seed(0)
    ref, grouped = _pair(_config(hidden, ffn))
    counts = torch.tensor(COUNTS)
    x = torch.randn(sum(COUNTS), hidden)  # [tokens, hidden], sorted by expert
    probs = torch.rand(sum(COUNTS))
    want, want_dx, want_dw = _run(ref, x, counts, probs)
    got, got_dx, got_dw = _run(grouped, x, counts, probs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_dx, want_dx, rtol=1e-5, atol=1e-5)
    assert sorted(got_dw) == sorted(want_dw) and len(want_dw) == 2 * len(COUNTS)
    for name, grad in want_dw.items():
        torch.testing.assert_close(got_dw[name], grad, rtol=1e-5, atol=1e-5, msg=name)
    idle = [i for i, c in enumerate(COUNTS) if c == 0]
    for i in idle:
        assert (got_dw[f"local_experts.{i}.linear_fc1.weight"] == 0).all()
    busy = [n for n in want_dw if int(n.split(".")[1]) not in idle]
    assert all(want_dw[n].abs().max() > 0 for n in busy)


def test_probs_on_the_input_equal_sequential_mlp(megatron_world):
    """``moe_apply_probs_on_input`` (top-1): probs scale the input, not the activation; 1e-5."""
    torch.manual_seed(1)
    config = _config(
        16, 8, moe_router_topk=1, moe_router_pre_softmax=True, moe_apply_probs_on_input=True
    )
    ref, grouped = _pair(config)
    counts, x = torch.tensor(COUNTS), torch.randn(sum(COUNTS), 16)
    probs = torch.rand(sum(COUNTS))
    want, want_dx, _ = _run(ref, x, counts, probs)
    got, got_dx, _ = _run(grouped, x, counts, probs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_dx, want_dx, rtol=1e-5, atol=1e-5)


def test_backward_saves_the_weights_not_a_stacked_copy():
    """The stacked weights are rebuilt in backward: the graph holds only the parameters."""
    weights = [torch.randn(8, 4, requires_grad=True) for _ in range(3)]
    x = torch.randn(6, 4, requires_grad=True)
    y = grouped_linear(x, torch.tensor([2, 2, 6], dtype=torch.int32), weights)
    saved = y.grad_fn.saved_tensors
    assert {t.data_ptr() for t in saved[2:]} == {w.data_ptr() for w in weights}
    assert all(t.shape != (3, 8, 4) for t in saved)


def test_no_tokens_give_an_empty_output_and_zero_weight_gradients():
    """A rank the dispatcher sent no tokens (expert parallelism) still back-propagates."""
    weights = [torch.randn(8, 4, requires_grad=True) for _ in range(3)]
    x = torch.zeros(0, 4, requires_grad=True)  # [tokens=0, in]
    y = grouped_linear(x, torch.zeros(3, dtype=torch.int32), weights)
    assert y.shape == (0, 8)
    y.sum().backward()
    assert x.grad.shape == (0, 4) and all((w.grad == 0).all() for w in weights)


def test_unsupported_configs_run_the_loop(megatron_world):
    config = _config(16, 8)
    assert grouped_supported(config)
    assert not grouped_supported(dataclasses.replace(config, add_bias_linear=True))
    assert not grouped_supported(
        dataclasses.replace(config, bias_activation_fusion=True, activation_func=F.gelu)
    )
