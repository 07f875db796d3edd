import pytest
import torch

from twinkle_fn.backends.compile_layers import (
    RecomputingPartitioner,
    compile_arguments,
    compile_layers,
)


def _layers():
    return [torch.nn.Linear(4, 4) for _ in range(3)]


def test_true_or_arguments_compile_every_layer_once():
    layers = _layers()
    compile_layers(layers, {"backend": "eager"})
    compiled = [layer._compiled_call_impl for layer in layers]
    assert all(c is not None for c in compiled)
    compile_layers(layers, {"backend": "eager", "fullgraph": True})  # kept as compiled first
    assert [layer._compiled_call_impl for layer in layers] == compiled
    x = torch.randn(2, 4)
    assert torch.equal(layers[0](x), torch.nn.functional.linear(x, *layers[0].parameters()))


def test_false_leaves_the_layers_eager():
    layers = _layers()
    compile_layers(layers, False)
    assert all(layer._compiled_call_impl is None for layer in layers)


@pytest.mark.parametrize("setting", ["yes", 1, None])
def test_other_values_are_refused(setting):
    with pytest.raises(TypeError, match="compile_layers must be True, False or a dict"):
        compile_layers(_layers(), setting)


def _mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """A SwiGLU MLP of `x` ``[tokens, 32]``: fc1 to ``[tokens, 2 * 48]``, ``silu(gate) * up``,
    fc2 to ``[tokens, 16]``. Its backward reads the SwiGLU product ``[tokens, 48]`` in fc2's
    weight-gradient matmul and the fc1 output in the SwiGLU's gradient."""
    gate, up = (x @ w1.t()).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ w2.t()


def _saved_and_grads(partition_fn):
    """Shapes saved for backward by `_mlp` split by `partition_fn` (no codegen: the graphs run
    as traced), its output and its input gradients."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_function

    fn = aot_function(
        _mlp,
        fw_compiler=lambda gm, _: make_boxed_func(gm),
        bw_compiler=lambda gm, _: make_boxed_func(gm),
        partition_fn=partition_fn,
    )
    g = torch.Generator().manual_seed(0)
    inputs = [
        torch.randn(shape, generator=g, requires_grad=True)
        for shape in ((64, 32), (96, 32), (16, 48))
    ]
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = tuple(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    out.backward(torch.ones_like(out))
    return set(saved.values()), out.detach(), *(t.grad for t in inputs)


def test_recomputing_partitioner_saves_no_swiglu_product_and_changes_no_number():
    """Inductor's default partition saves the ``[64, 48]`` product for the weight gradient; ours
    rebuilds it from the saved fc1 output, and the output and gradients are bit-identical."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    default = _saved_and_grads(min_cut_rematerialization_partition)
    ours = _saved_and_grads(RecomputingPartitioner())
    assert (64, 48) in default[0]
    assert (64, 48) not in ours[0] and (64, 96) in ours[0]
    for a, b in zip(default[1:], ours[1:], strict=True):
        assert torch.equal(a, b)


def test_a_memory_budget_saves_less_and_changes_no_number():
    """Budget 0 keeps only the graph's inputs: the fc1 output is recomputed too (a matmul)."""
    full = _saved_and_grads(RecomputingPartitioner())
    none = _saved_and_grads(RecomputingPartitioner(memory_budget=0.0))
    assert (64, 96) in full[0]
    assert none[0] == {(64, 32), (96, 32), (16, 48)}
    for a, b in zip(full[1:], none[1:], strict=True):
        assert torch.equal(a, b)
    assert RecomputingPartitioner(0.5).uuid() != RecomputingPartitioner().uuid()
    with pytest.raises(ValueError, match=r"memory_budget must be in \[0, 1\], got 1.5"):
        RecomputingPartitioner(memory_budget=1.5)


def test_compile_arguments_add_the_partitioner_to_inductor_only():
    args = compile_arguments(True)
    assert args["options"]["custom_partitioner_fn"].memory_budget == 1.0
    tuned = compile_arguments({"mode": "max-autotune-no-cudagraphs", "fullgraph": True})
    assert "mode" not in tuned and tuned["fullgraph"] is True
    assert tuned["options"]["max_autotune"] is True  # the mode, as options
    budget = compile_arguments({"memory_budget": 0.6})
    assert budget["options"]["custom_partitioner_fn"].memory_budget == 0.6
    own = compile_arguments({"options": {"custom_partitioner_fn": None}})
    assert own == {"options": {"custom_partitioner_fn": None}}
    assert compile_arguments({"backend": "eager"}) == {"backend": "eager"}
    for setting in ({"backend": "eager", "memory_budget": 0.5}, {**own, "memory_budget": 0.5}):
        with pytest.raises(ValueError, match="memory_budget sets inductor's partitioner"):
            compile_arguments(setting)
    with pytest.raises(ValueError, match="memory_budget must be in"):
        compile_arguments({"memory_budget": -0.1})


def _qwen2_layer_run(setting, device="cpu"):
    """Saved-for-backward bytes, output and gradients of one tiny float32 Qwen2 decoder layer
    on `device` compiled by `compile_layers` with `setting` (inductor)."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    torch._dynamo.reset()
    config = Qwen2Config(
        hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2
    )
    torch.manual_seed(0)
    layer = Qwen2DecoderLayer(config, layer_idx=0).to(device)
    x = torch.randn(2, 32, 64, device=device, requires_grad=True)  # [batch, seq, hidden]
    positions = torch.arange(32, device=device)[None].expand(2, -1)
    rope = Qwen2RotaryEmbedding(config).to(device)(x, positions)
    compile_layers([layer], setting)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x, position_embeddings=rope, position_ids=positions)
    out = out[0] if isinstance(out, tuple) else out
    out.square().sum().backward()
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    activations = sum(n for ptr, n in saved.items() if ptr not in weights)
    return activations, out.detach(), x.grad, [p.grad for p in layer.parameters()]


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(
                    not torch.cuda.is_available(), reason="inductor's CUDA kernels need a GPU"
                ),
            ],
        ),
    ],
)
def test_a_compiled_decoder_layer_saves_less_at_each_step_and_computes_the_same(device):
    """Inductor's own partition > ours > ours at budget 0, in saved activation bytes; the
    output and gradients agree to float32 rounding (the kernels fuse differently)."""
    default, ours, none = (
        _qwen2_layer_run(s, device)
        for s in ({"options": {"custom_partitioner_fn": None}}, True, {"memory_budget": 0.0})
    )
    assert default[0] > ours[0] > none[0]
    for run in (ours, none):
        torch.testing.assert_close(run[1], default[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(run[2], default[2], rtol=1e-5, atol=1e-5)
        for got, want in zip(run[3], default[3], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
