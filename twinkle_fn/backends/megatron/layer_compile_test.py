"""Compiled megatron MoE layers: the token dispatcher runs eagerly (never traced), the router is
compiled, and a compiled step equals the eager one."""

import pytest
import torch
import torch.distributed as dist

import twinkle_fn as tf
from twinkle_fn.backends.megatron import parallel
from twinkle_fn.backends.megatron.backend import megatron_optimizer
from twinkle_fn.backends.megatron.layer_compile import compile_decoder_layers
from twinkle_fn.data import pack
from twinkle_fn.testing import random_features, tiny_config


def _step(options: dict, traced: dict[str, list[bool]] | None = None, **kw):
    """One AdamW step of the tiny qwen3_moe on one process (`kw`: `from_hf_config`'s device
    and precision): (loss, grad norm, params). With `traced`, records for every call of the
    first MoE layer's dispatcher and router whether dynamo was tracing it."""
    model = tf.models.from_hf_config(
        tiny_config("qwen3_moe"), seed=0, backend="megatron", options=options, **kw
    )
    state = tf.init(model, megatron_optimizer(1e-2))
    if traced is not None:
        moe = next(
            layer.mlp
            for layer in state.model.placement.module.decoder.layers
            if hasattr(layer.mlp, "token_dispatcher")
        )
        _record(moe.token_dispatcher, "token_dispatch", traced["dispatch"])
        _record(moe.router, "routing", traced["router"])
    grads, _ = tf.fwd_bwd(state, pack(random_features(8)))
    state, info = tf.step(state, grads)
    params = {k: v.detach().float().cpu() for k, v in tf.unshard(state).items()}
    parallel.destroy()
    return float(info["loss"]), float(info["grad_norm"]), params


def _record(obj: object, method: str, calls: list[bool]) -> None:
    inner = getattr(obj, method)

    def wrapper(*args, **kwargs):
        calls.append(torch.compiler.is_compiling())
        return inner(*args, **kwargs)

    setattr(obj, method, wrapper)


@pytest.fixture(scope="module")
def runs(megatron_world):
    eager = _step({})
    traced = {"dispatch": [], "router": []}
    compiled = _step({"compile_layers": {"backend": "aot_eager"}}, traced)
    return eager, compiled, traced


def test_the_dispatcher_stays_eager_and_the_router_compiles(runs):
    _, _, traced = runs
    assert traced["dispatch"] and not any(traced["dispatch"])
    assert any(traced["router"])


def test_a_compiled_moe_step_equals_the_eager_one(runs):
    (loss, norm, params), (c_loss, c_norm, c_params), _ = runs
    # aot_eager runs the same aten ops as eager: float32 differences are reassociation only.
    assert c_loss == pytest.approx(loss, rel=1e-6)
    assert c_norm == pytest.approx(norm, rel=1e-5)
    for name, value in params.items():
        torch.testing.assert_close(c_params[name], value, rtol=1e-5, atol=1e-6)


def test_a_bad_setting_is_refused_before_any_layer_changes():
    layer = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="compile_layers must be True, False or a dict"):
        compile_decoder_layers([layer], "yes")
    assert getattr(layer, "_compiled_call_impl", None) is None


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device: the dispatcher's "
    "side-stream copies (record_stream) and bf16 grouped GEMMs run only there",
)
def test_compiled_moe_layers_train_on_cuda_with_inductor():
    """Inductor (the option's default) where the dispatcher really copies its counts on a side
    stream: the compiled step equals the eager one within bf16 rounding."""
    try:
        eager = _step({}, device="cuda", precision="bf16")
        compiled = _step({"compile_layers": True}, device="cuda", precision="bf16")
    finally:
        if dist.is_initialized():  # tf.init started a one-rank group of its own
            dist.destroy_process_group()
    # bf16 activations, fp32 master weights: kernels fused differently round differently.
    assert compiled[0] == pytest.approx(eager[0], rel=2e-2)
    assert compiled[1] == pytest.approx(eager[1], rel=5e-2)
