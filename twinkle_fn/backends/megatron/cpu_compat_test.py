import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import random as mpu_random
from megatron.core.transformer import TransformerConfig

from twinkle_fn.backends.megatron import cpu_compat
from twinkle_fn.testing_dist import free_port

_CUDA_NAMES = (
    "current_device",
    "current_stream",
    "default_stream",
    "Stream",
    "Event",
    "stream",
    "synchronize",
    "empty_cache",
)
_RNG_NAMES = (
    "_CUDA_RNG_STATE_TRACKER",
    "_CUDA_RNG_STATE_TRACKER_INITIALIZED",
    "_get_cuda_rng_state",
    "_set_cuda_rng_state",
)


def _patched_attributes():
    backward_apply = torch.autograd.function.BackwardCFunction.apply
    return (
        [getattr(torch.cuda, n) for n in _CUDA_NAMES]
        + [getattr(mpu_random, n) for n in _RNG_NAMES]
        + [backward_apply]
    )


def test_enable_refuses_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="never be active on a GPU"):
        cpu_compat.enable()
    with pytest.raises(RuntimeError, match="never be active on a GPU"), cpu_compat.cpu_mode():
        pass
    assert not cpu_compat.is_enabled()


def test_disable_restores_every_attribute_exactly():
    before = _patched_attributes()
    cpu_compat.enable()
    cpu_compat.enable()  # idempotent: one mode, one set of saved originals
    assert cpu_compat.is_enabled()
    assert torch.overrides._get_current_function_mode_stack().count(cpu_compat._PATCH.mode) == 1
    assert all(a is not b for a, b in zip(_patched_attributes(), before, strict=True))
    cpu_compat.disable()
    assert not cpu_compat.is_enabled()
    assert all(a is b for a, b in zip(_patched_attributes(), before, strict=True))
    assert torch.overrides._get_current_function_mode_stack() == []
    cpu_compat.disable()  # a no-op when disabled


def test_disable_refuses_while_a_later_mode_is_active():
    with cpu_compat.cpu_mode():
        inner = torch.overrides.TorchFunctionMode()
        with inner:
            with pytest.raises(RuntimeError, match="exit it before"):
                cpu_compat.disable()
            assert cpu_compat.is_enabled()
    assert not cpu_compat.is_enabled()


def test_cpu_mode_nests_and_only_the_outer_block_disables():
    with cpu_compat.cpu_mode():
        with cpu_compat.cpu_mode():
            pass
        assert cpu_compat.is_enabled()
    assert not cpu_compat.is_enabled()


def test_cuda_devices_map_to_the_cpu_and_types_read_as_cuda():
    with cpu_compat.cpu_mode():
        for device in ("cuda", "cuda:1", 0, torch.device("cuda", 0), torch.cuda.current_device()):
            assert torch.empty(2, device=device).device.type == "cpu"
        x = torch.ones(3, pin_memory=True)
        assert x.cuda() is x and x.pin_memory() is x
        assert x.to("cuda").device.type == "cpu"
        assert x.to("cuda:0", torch.float64).dtype == torch.float64
        assert x.to(device=0).device.type == "cpu"
        assert x.type() == "torch.cuda.FloatTensor"
        assert x.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        assert x.type(torch.cuda.HalfTensor).dtype == torch.float16
        assert x.type("torch.cuda.DoubleTensor").dtype == torch.float64
        stream = torch.cuda.current_stream()
        assert stream is torch.cuda.default_stream()
        side = torch.cuda.Stream(device=torch.cuda.current_device())
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        stream.wait_event(event)
        assert event.query() and side.record_event().query()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    assert x.type() == "torch.FloatTensor"
    with pytest.raises((RuntimeError, AssertionError)):
        torch.empty(1, device="cuda")


def test_tracker_forks_named_cpu_streams_and_leaves_the_default_one_alone():
    tracker = cpu_compat.CpuRNGStatesTracker()
    tracker.add("a", 5)
    tracker.add("b", 6)
    ref_a, ref_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)
    torch.manual_seed(0)
    expected_default = torch.rand(8)
    torch.manual_seed(0)
    with tracker.fork("a"):
        first = torch.rand(4)
        with tracker.fork("b"):
            nested = torch.rand(4)
        after_nested = torch.rand(4)
    with tracker.fork("a"):
        second = torch.rand(4)
    assert torch.equal(torch.rand(8), expected_default)
    assert torch.equal(torch.cat([first, after_nested, second]), torch.rand(12, generator=ref_a))
    assert torch.equal(nested, torch.rand(4, generator=ref_b))
    with pytest.raises(ValueError, match="seed 5 is already tracked"):
        tracker.add("c", 5)
    with pytest.raises(ValueError, match="'a' is already tracked"):
        tracker.add("a", 7)
    with pytest.raises(ValueError, match="'z' is not tracked"), tracker.fork("z"):
        pass


@pytest.fixture(scope="module")
def megatron_world():
    """One gloo process with megatron-core's groups (tp = pp = 1) under the CPU patch."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    cpu_compat.enable()
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        cpu_compat.disable()
        dist.destroy_process_group()


def _config(**overrides) -> TransformerConfig:
    fields = dict(
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        calculate_per_token_loss=True,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
        finalize_model_grads_func=finalize_model_grads,
    )
    return TransformerConfig(**{**fields, **overrides})


def _seeded_model(config: TransformerConfig) -> GPTModel:
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    return GPTModel(
        config,
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=64,
        max_sequence_length=32,
        position_embedding_type="rope",
    )


def _batch():
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    return ids, torch.arange(16).expand(2, 16)


def _train_step(model: GPTModel, config: TransformerConfig):
    """One megatron training step: DDP + distributed optimizer + forward_backward_func."""
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True),
        model,
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-2,
            weight_decay=0.0,
            clip_grad=1.0,
            use_distributed_optimizer=True,
        ),
        [ddp],
    )
    ids, pos = _batch()

    def forward_step(_, module):
        losses = module(ids, pos, None, labels=ids)
        return losses, lambda out: (out.sum(), torch.tensor(out.numel()), {"loss": out.sum()})

    ddp.zero_grad_buffer()
    opt.zero_grad()
    torch.manual_seed(2)
    tensor_parallel.model_parallel_cuda_manual_seed(2)
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=None,
        model=[ddp],
        num_microbatches=1,
        seq_length=16,
        micro_batch_size=2,
    )
    grads = {n: p.main_grad.clone() for n, p in ddp.module.named_parameters()}
    ok, grad_norm, _ = opt.step()
    assert ok
    return grad_norm, grads


def test_gpt_model_trains_a_step_like_plain_torch(megatron_world):
    """Megatron's grads, clipped norm and Adam update equal plain autograd + torch's clip/Adam.

    fp32 on one CPU: the same kernels in the same order, so 1e-6 (absolute) is loose.
    """
    config = _config()
    model = _seeded_model(config)
    reference = _seeded_model(config)  # the same seeded CPU init: identical weights
    grad_norm, grads = _train_step(model, config)

    ids, pos = _batch()
    # calculate_per_token_loss: megatron divides the summed loss's grads by the token count.
    reference(ids, pos, None, labels=ids).mean().backward()
    named = dict(reference.named_parameters())
    for name, param in named.items():
        torch.testing.assert_close(grads[name], param.grad, rtol=0, atol=1e-6, msg=name)
        # Adam's first step is ~lr * sign(grad): feed it megatron's grads, not the reference's,
        # so that grads near zero cannot flip a sign.
        param.grad = grads[name].clone()
    want_norm = torch.nn.utils.clip_grad_norm_(named.values(), max_norm=1.0)
    assert grad_norm == pytest.approx(want_norm.item(), rel=1e-6)
    torch.optim.Adam(named.values(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8).step()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, named[name], rtol=0, atol=1e-6, msg=name)


def test_full_recompute_replays_dropout_from_the_cpu_rng(megatron_world):
    """Recompute re-runs the forward in backward: its dropout masks must be the first pass's.

    The grads match only if recompute saves and restores the CPU generator and the tracker's
    states (``_get/_set_cuda_rng_state`` must not touch CUDA); the local spec's attention also
    allocates ``device='cuda'`` during the recompute, which runs inside ``backward``.
    """
    dropout = dict(hidden_dropout=0.2, attention_dropout=0.2)
    plain = _config(**dropout)
    recompute = _config(
        **dropout, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    _, want = _train_step(_seeded_model(plain), plain)
    _, got = _train_step(_seeded_model(recompute), recompute)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)


def test_all_to_all_takes_split_sizes_given_as_cpu_tensors(megatron_world):
    """megatron's MoE dispatcher leaves its split sizes as tensors when they are not on CUDA."""
    src = torch.arange(6.0)
    out = torch.empty(6)
    splits = torch.tensor([6])
    dist.all_to_all_single(out, src, output_split_sizes=splits, input_split_sizes=splits)
    assert torch.equal(out, src)
