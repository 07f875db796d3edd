import pytest
import torch

from twinkle_fn.backends.compile_layers import compile_layers


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
