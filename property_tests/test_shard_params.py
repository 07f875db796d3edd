"""``unshard_params(every rank's shard_params(p)) == p`` on both backends, on one process.

Random meshes the tiny models admit (transformers: tp, fsdp and dp, fsdp splits uneven; megatron:
tp, pp, cp, dp, and ep / etp on Qwen3-MoE, vocabulary padding included) and random tensors of
the models' own shapes, rebuilt exactly from the pieces each rank would hold.
"""

import functools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM
from transformers.core_model_loading import revert_weight_conversion

from twinkle_fn import backends
from twinkle_fn.mesh import Mesh
from twinkle_fn.models.model import Model
from twinkle_fn.testing import tiny_config

SETTINGS = settings(max_examples=40, deadline=None)
DTYPES = (torch.float32, torch.bfloat16, torch.float64)


@functools.cache
def _skeleton(family: str, tied: bool, vocab: int) -> torch.nn.Module:
    # Shapes only: the meta device allocates nothing.
    config = tiny_config(family, tie_word_embeddings=tied, vocab_size=vocab)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _random(shapes: dict[str, torch.Size], seed: int, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        n: torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for n, s in shapes.items()
    }


def _round_trip(backend: str, full: dict, mesh: Mesh, model: Model) -> dict:
    impl = backends.get(backend)
    pieces = {r: impl.shard_params(full, mesh, model, r) for r in range(mesh.world_size)}
    return impl.unshard_params(pieces, mesh, model)


def _assert_equal(back: dict, full: dict) -> None:
    assert back.keys() == full.keys()
    for name, tensor in full.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


@st.composite
def transformers_case(draw: st.DrawFn):
    family = draw(st.sampled_from(["llama", "mistral", "qwen2", "qwen3", "qwen3_moe"]))
    tied, vocab = draw(st.booleans()), draw(st.sampled_from([96, 97, 101]))
    # tiny models: 4 heads, 2 kv heads, 64 MLP features -> tp 1 or 2
    mesh = Mesh(
        tp=draw(st.sampled_from([1, 2])),
        fsdp=draw(st.integers(1, 5)),
        dp=draw(st.integers(1, 3)),
    )
    return family, tied, vocab, mesh


@SETTINGS
@given(transformers_case(), st.integers(0, 2**16), st.sampled_from(DTYPES))
def test_transformers_pieces_rebuild_the_params(case, seed, dtype):
    family, tied, vocab, mesh = case
    module = _skeleton(family, tied, vocab)
    full = _random({n: t.shape for n, t in module.state_dict().items()}, seed, dtype)
    _assert_equal(_round_trip("transformers", full, mesh, Model(module, family)), full)


@st.composite
def megatron_case(draw: st.DrawFn):
    family = draw(st.sampled_from(["llama", "mistral", "qwen2", "qwen3", "qwen3_moe"]))
    tied, vocab = draw(st.booleans()), draw(st.sampled_from([96, 97]))
    # tiny models: 4 heads, 2 kv heads (tp 4 replicates them), 2 layers, 4 experts of 16 features
    tp, pp, cp, dp = (
        draw(st.sampled_from([1, 2, 4])),
        draw(st.sampled_from([1, 2])),
        draw(st.sampled_from([1, 2])),
        draw(st.sampled_from([1, 2])),
    )
    ep = etp = 1
    if family == "qwen3_moe":
        stage = tp * cp * dp
        ep = draw(st.sampled_from([d for d in (1, 2, 4) if stage % d == 0]))
        etp = draw(st.sampled_from([d for d in (1, 2, 4) if (stage // ep) % d == 0]))
    mesh = Mesh(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, etp=etp)
    return family, tied, vocab, mesh, draw(st.sampled_from([1, 8, 128]))


@SETTINGS
@given(megatron_case(), st.integers(0, 2**16), st.sampled_from(DTYPES))
def test_megatron_pieces_rebuild_the_params(case, seed, dtype):
    family, tied, vocab, mesh, multiple = case
    module = _skeleton(family, tied, vocab)
    # Checkpoint names (one tensor per expert), as the megatron backend gives them back; a tied
    # model's lm_head is the embedding itself.
    names = revert_weight_conversion(module, module.state_dict())
    shapes = {n: t.shape for n, t in names.items() if not (tied and n == "lm_head.weight")}
    full = _random(shapes, seed, dtype)
    model = Model(module, family, backend="megatron", options={"vocab_multiple": multiple})
    _assert_equal(_round_trip("megatron", full, mesh, model), full)
