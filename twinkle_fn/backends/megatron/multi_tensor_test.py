import pytest
import torch
from megatron.core import utils as mcore_utils
from megatron.core.optimizer import clip_grads

import twinkle_fn as tf
from twinkle_fn.backends.megatron import multi_tensor, parallel
from twinkle_fn.backends.megatron.backend import megatron_optimizer
from twinkle_fn.testing import tiny_config


def _tensors(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen).to(dtype) for shape in [(3, 5), (7,), (2, 2, 2), ()]]


def _flat_norm(tensors):
    return torch.cat([t.double().reshape(-1) for t in tensors]).norm()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2_norm_is_the_norm_of_all_tensors_as_one_vector(dtype):
    tensors = _tensors(dtype)
    norm, per_tensor = multi_tensor.l2_norm(2048, torch.zeros(1, dtype=torch.int), [tensors], False)
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    # float32 sums of the tensors' own values (bf16 inputs are exact in float32)
    torch.testing.assert_close(norm[0].double(), _flat_norm(tensors), rtol=1e-6, atol=0)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_scale_in_place_and_into_other_tensors(as_tensor):
    src = _tensors()
    expected = [t * 0.25 for t in src]
    factor = torch.tensor([0.25]) if as_tensor else 0.25
    dst = [torch.empty_like(t) for t in src]
    multi_tensor.scale(2048, None, [src, dst], factor)
    assert all(torch.equal(d, e) for d, e in zip(dst, expected, strict=True))
    multi_tensor.scale(2048, None, [src, src], factor)
    assert all(torch.equal(s, e) for s, e in zip(src, expected, strict=True))


def test_scale_by_one_copies_into_another_dtype():
    src = _tensors()
    dst = [torch.empty_like(t, dtype=torch.bfloat16) for t in src]
    multi_tensor.scale(2048, None, [src, dst], 1.0)
    assert all(torch.equal(d, s.bfloat16()) for d, s in zip(dst, src, strict=True))


@pytest.fixture
def restored_clip_grads(monkeypatch):
    """megatron's module globals as they were, whatever `install` does to them here."""
    for name in ("l2_norm_impl", "multi_tensor_scale_impl", "multi_tensor_scale_tensor_impl"):
        monkeypatch.setattr(clip_grads, name, getattr(clip_grads, name))


def test_install_replaces_only_megatrons_local_fallbacks(restored_clip_grads, monkeypatch):
    monkeypatch.setattr(clip_grads, "l2_norm_impl", mcore_utils.local_multi_tensor_l2_norm)
    multi_tensor.install()
    multi_tensor.install()  # idempotent
    assert clip_grads.l2_norm_impl is multi_tensor.l2_norm
    assert clip_grads.multi_tensor_scale_tensor_impl is multi_tensor.scale

    def kernel(*args):  # what TE or apex would have provided
        raise AssertionError("not called")

    monkeypatch.setattr(clip_grads, "l2_norm_impl", kernel)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_tensor_impl", None)
    multi_tensor.install()
    assert clip_grads.l2_norm_impl is kernel and clip_grads.multi_tensor_scale_tensor_impl is None


def test_megatron_clips_by_a_norm_it_never_reads(megatron_world, restored_clip_grads, monkeypatch):
    monkeypatch.setattr(clip_grads, "l2_norm_impl", mcore_utils.local_multi_tensor_l2_norm)
    multi_tensor.install()
    params = [torch.nn.Parameter(t) for t in _tensors()]
    for p in params:
        p.grad = p.detach() * 3
    expected_norm = _flat_norm([p.grad for p in params])
    norm = clip_grads.get_grad_norm_fp32([p.grad for p in params])
    # a tensor: megatron's local fallback returns a float read on the host
    assert isinstance(norm, torch.Tensor)
    torch.testing.assert_close(norm.double().reshape(()), expected_norm, rtol=1e-6, atol=0)
    expected = [p.grad * (1.0 / (norm.reshape(()) + 1e-6)) for p in params]
    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=norm)
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.grad, e, rtol=1e-6, atol=1e-7)
    assert _flat_norm([p.grad for p in params]) == pytest.approx(1.0, rel=1e-5)


def test_scale_grad_buffers_multiplies_as_megatrons_scale_gradients(megatron_world):
    """Megatron's own ``scale_gradients`` over the same buffers is the reference: the same
    float32 products, bit for bit (the 0-d float64 factor rounds to float32 in both)."""
    state = tf.init(
        tf.models.from_hf_config(tiny_config("qwen2"), seed=0, backend="megatron"),
        megatron_optimizer(1e-2),
    )
    chunks = state.model.placement.chunks
    buffers = [b for chunk in chunks for b in chunk.buffers + chunk.expert_parallel_buffers]
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(b.grad_data.shape, generator=gen) for b in buffers]
    factor = 1.0 / torch.tensor(977).double()
    try:
        results = []
        for scale in (multi_tensor.scale_grad_buffers, _megatron_scale):
            for buffer, grad in zip(buffers, grads, strict=True):
                buffer.grad_data.copy_(grad)
            scale(chunks, factor)
            results.append([b.grad_data.clone() for b in buffers])
    finally:
        parallel.destroy()
    ours, megatrons = results
    assert all(torch.equal(a, b) for a, b in zip(ours, megatrons, strict=True))
    assert not torch.equal(ours[0], grads[0])


def _megatron_scale(chunks, factor):
    for chunk in chunks:
        chunk.scale_gradients(factor)
