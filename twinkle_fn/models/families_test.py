"""twinkle_fn/models/families.py: every row agrees with what transformers builds for its family,
and a new family is one row (tried out here under `registered`, on both backends)."""

import dataclasses
import importlib
import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

import twinkle_fn as tf
from twinkle_fn.data import pack
from twinkle_fn.models.families import (
    COLWISE,
    FAMILIES,
    ROWWISE,
    Family,
    family,
    family_of,
    known,
    registered,
)
from twinkle_fn.testing import random_features, tiny_config
from twinkle_fn.testing_dist import spawn

# HF parameters of each bias part in the Llama layout every row's plan is written against.
_BIASES = {
    "qkv": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "o": ("self_attn.o_proj.bias",),
    "mlp": ("mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias"),
}


def _module(config: PretrainedConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _has(module: torch.nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def _copy_of_qwen2() -> tuple[Family, PretrainedConfig]:
    """A family that only differs from qwen2 by its name: its row and a tiny config of it."""
    config = tiny_config("qwen2")
    config.model_type = "qwen2_copy"
    return dataclasses.replace(family("qwen2"), name="qwen2_copy"), config


@pytest.mark.parametrize("name", FAMILIES)
def test_each_row_is_found_by_name_and_by_config(name):
    row = family(name)
    assert row.name == name and family(tiny_config(name)) is row
    assert family_of(tiny_config(name)) == name


@pytest.mark.parametrize("name", FAMILIES)
def test_the_plan_splits_real_linears_and_sequence_parallelism_needs_a_rowwise_mlp(name):
    row = family(name)
    layers = _module(tiny_config(name, mlp_only_layers=[0])).model.layers
    # MLA without a query down projection has q_proj instead (other families ignore the field)
    layers = [*layers, *_module(tiny_config(name, q_lora_rank=None)).model.layers]
    for sub, style in row.tp_plan.items():
        linears = [layer.get_submodule(sub) for layer in layers if _has(layer, sub)]
        assert linears and all(isinstance(m, torch.nn.Linear) for m in linears), sub
        # colwise outputs / rowwise inputs are the split side: heads or MLP channels
        split = [m.out_features if style == COLWISE else m.in_features for m in linears]
        assert all(n % 2 == 0 for n in split), (sub, split)
    styles = set(row.tp_plan.values())
    assert styles == {COLWISE, ROWWISE}
    rowwise_mlp = any(s.startswith("mlp.") and v == ROWWISE for s, v in row.tp_plan.items())
    # The norms the transformers backend's sequence-parallel plan runs on sequence shards
    # (plans.SEQUENCE_PARALLEL_LAYER); another norm (Gemma 3's around the MLP) would not be.
    norms = {n for n, _ in layers[0].named_children() if "norm" in n}
    # ... and every token mixer is the attention it gathers the sequence for (not a DeltaNet)
    planned = norms <= {"input_layernorm", "post_attention_layernorm"} and all(
        _has(layer, "self_attn") for layer in layers
    )
    # an MoE block's output is not a rowwise linear's, even with a split shared expert
    assert row.sequence_parallel == (rowwise_mlp and row.moe is None and planned)
    if row.moe is not None:  # experts stay whole under tp
        assert not any(s.startswith(row.moe.experts) for s in row.tp_plan)


@pytest.mark.parametrize("on", [False, True])
@pytest.mark.parametrize("name", FAMILIES)
def test_biases_and_qk_norms_are_what_transformers_builds(name, on):
    """With every bias field of the HF configs on, and off: a row's bias is on exactly when
    transformers gives the projection a bias (layer 0 is dense, so the MLP has projections; the
    first attention layer is read)."""
    config = tiny_config(name, attention_bias=on, mlp_bias=on, use_qk_norm=on, mlp_only_layers=[0])
    row = family(name)
    # the first attention layer (Qwen3.5 begins with a DeltaNet layer)
    layer = next(lay for lay in _module(config).model.layers if _has(lay, "self_attn"))
    params = dict(layer.named_parameters())
    for part, names in _BIASES.items():
        assert [n in params for n in names] == [row.has_bias(part, config)] * len(names), part
    for norm in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
        assert (norm in params) == row.has_qk_norm(config)


def _last_logits_see_token_0(config: PretrainedConfig) -> bool:
    module = _module(config)
    ids = torch.randint(1, config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[0, 0] = (ids[0, 0] % (config.vocab_size - 1)) + 1
    with torch.no_grad():
        a, b = (module(input_ids=x, use_cache=False).logits[0, -1] for x in (ids, changed))
    # MoE experts batch tokens by route, so unrelated tokens move logits by float32 rounding
    return not torch.allclose(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_sliding_window_field_is_what_transformers_windows(name):
    """A window of 2 tokens over 2 layers: the last of 8 positions sees back to position 5, so
    token 0 cannot reach it. A row without a window field is not windowed by ``sliding_window``
    (Qwen2/Qwen3 window per layer only with ``use_sliding_window``)."""
    row = family(name)
    if row.sliding_window is None:
        config = tiny_config(name, sliding_window=2)
        assert row.window(config) is None and _last_logits_see_token_0(config)
        return
    config = tiny_config(name, **{row.sliding_window: 2, "use_sliding_window": True})
    assert row.window(config) == 2 and not _last_logits_see_token_0(config)
    assert row.window(tiny_config(name, **{row.sliding_window: None})) is None


@pytest.mark.parametrize("name", FAMILIES)
def test_only_a_mask_mapping_decoder_takes_the_mapping(name):
    config = tiny_config(name)
    if set(getattr(config, "layer_types", None) or ()) - {"full_attention"}:
        # the backend hands the mapping over only when every layer attends fully
        config = tiny_config(name, layer_types=["full_attention"] * config.num_hidden_layers)
    module = _module(config)
    ids = torch.randint(1, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = module(input_ids=ids, use_cache=False).logits
        if not family(name).mask_mapping:
            with pytest.raises(AttributeError):
                module(input_ids=ids, attention_mask={"full_attention": None}, use_cache=False)
            return
        mapped = module(input_ids=ids, attention_mask={"full_attention": None}, use_cache=False)
    assert torch.equal(plain, mapped.logits)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_rope_kind_is_the_modeling_code(name):
    """DeepSeek's interleaved pairs are its default (``rope_interleave``); the others rotate
    halves only."""
    config = tiny_config(name)
    modeling = importlib.import_module(type(_module(config)).__module__)
    if family(name).rope == "interleaved":
        assert config.rope_interleave and hasattr(modeling, "apply_rotary_pos_emb_interleave")
        return
    assert family(name).rope == "rotate_half" and hasattr(modeling, "rotate_half")
    assert not getattr(config, "rope_interleave", False)


@pytest.mark.parametrize("name", FAMILIES)
def test_latent_attention_is_what_transformers_builds(name):
    """Multi-latent attention's key/value down projection is in every layer of the rows that
    say so, and in none of the others'."""
    layers = _module(tiny_config(name)).model.layers
    latent = [_has(layer, "self_attn.kv_a_proj_with_mqa") for layer in layers]
    assert latent == [family(name).latent_attention] * len(layers)


def test_unknown_families_are_refused_naming_the_field_and_the_known_ones():
    with pytest.raises(ValueError, match=r"'gpt2' \(config.model_type\)") as err:
        family_of(AutoConfig.for_model("gpt2"))
    assert all(name in str(err.value) for name in FAMILIES)
    with pytest.raises(ValueError, match="unknown model family 'gpt2'") as err:
        family("gpt2")
    assert all(name in str(err.value) for name in FAMILIES)
    with pytest.raises(ValueError, match=r"config\.model_type"):
        family(AutoConfig.for_model("gpt2"))


def test_a_multimodal_wrapper_is_refused_naming_its_text_config():
    with pytest.raises(ValueError, match="'gemma3' wraps a vision tower") as err:
        family_of(AutoConfig.for_model("gemma3"))
    assert "model_type 'gemma3_text'" in str(err.value)


def test_registered_rows_are_known_inside_the_block_only():
    row, config = _copy_of_qwen2()
    assert "qwen2_copy" not in known()
    with registered(row):
        assert family(config) is row and family_of(config) == "qwen2_copy"
        assert known() == (*FAMILIES, "qwen2_copy")
        with registered(dataclasses.replace(row, qk_norm=True)):
            assert family("qwen2_copy").qk_norm
        assert family("qwen2_copy") is row
    with pytest.raises(RuntimeError), registered(row):
        raise RuntimeError("the block failed")
    assert known() == FAMILIES
    with pytest.raises(ValueError, match="unknown model family 'qwen2_copy'"):
        family_of(config)
    with pytest.raises(ValueError, match="share a name"), registered(row, row):
        pass


def _one_step(name: str, backend: str) -> tuple[float, float]:
    """A fresh model of `name` (qwen2 or its copy): one `fwd_bwd` and `step` on `backend`.

    Returns the loss sum and how far the step moved the parameters (the sum of all changes).
    """
    row, config = _copy_of_qwen2()
    if name == "qwen2":
        config = tiny_config("qwen2")
    batch = pack(random_features(4, seed=3))
    with registered(row):
        model = tf.models.from_hf_config(config, backend=backend, seed=0)
        if backend == "megatron":
            tx = tf.optim.megatron_optimizer(1e-2, clip_grad=0.0, weight_decay=0.0)
        else:
            tx = tf.optim.adamw(1e-2, weight_decay=0.0)
        state = tf.init(model, tx)
        before = {n: p.detach().clone() for n, p in state.params.items()}
        grads, aux = tf.fwd_bwd(state, batch)
        state, _ = tf.step(state, grads)
        moved = sum(float((p.detach() - before[n]).abs().sum()) for n, p in state.params.items())
    return float(aux["loss_sum"]), moved


def _both_on_megatron() -> dict[str, tuple[float, float]]:
    return {name: _one_step(name, "megatron") for name in ("qwen2", "qwen2_copy")}


def test_a_new_family_is_one_row_on_the_transformers_backend():
    """A copy of qwen2 under another model_type trains exactly as qwen2 does."""
    copy, want = _one_step("qwen2_copy", "transformers"), _one_step("qwen2", "transformers")
    assert math.isfinite(copy[0]) and copy[1] > 0
    assert copy == want


@pytest.mark.slow
def test_a_new_family_is_one_row_on_the_megatron_backend():
    """The same copy through megatron-core (one spawned rank: the bridge, config and spec read
    its row)."""
    (runs,) = spawn(_both_on_megatron, 1)
    assert math.isfinite(runs["qwen2_copy"][0]) and runs["qwen2_copy"][1] > 0
    assert runs["qwen2_copy"] == runs["qwen2"]


@pytest.mark.parametrize("name", FAMILIES)
def test_linear_attention_norm_offset_and_attention_gate_are_what_transformers_builds(name):
    """`linear_attention`'s rule names exactly the layers transformers gives its DeltaNet
    module (4 layers, every second one attending fully); `norm_offset` rows zero-initialise
    the decoder norms and scale by 1 + weight (a weight of -1 zeroes the output);
    `attention_gate` rows give q_proj twice the query rows."""
    row = family(name)
    config = tiny_config(name, num_hidden_layers=4 if row.linear_attention else 2)
    module = _module(config)
    layers = module.model.layers
    linear = row.linear_attention
    if linear is None:
        assert not any(_has(lay, "linear_attn") for lay in layers)
    else:
        got = tuple(i for i, lay in enumerate(layers) if _has(lay, linear.module))
        assert got == linear.layers(config) == (0, 2)
    attention = next(lay for lay in layers if _has(lay, "self_attn")).self_attn
    if hasattr(attention, "head_dim"):  # not multi-latent attention
        rows = config.num_attention_heads * attention.head_dim
        assert attention.q_proj.weight.shape[0] == rows * (2 if row.attention_gate else 1)
    else:
        assert not row.attention_gate
    norm = layers[0].input_layernorm
    if row.norm_offset:
        assert not norm.weight.any()
        with torch.no_grad():
            norm.weight.fill_(-1.0)
            assert not norm(torch.randn(3, config.hidden_size)).any()
    elif name != "gemma3_text":  # Gemma 3's (1 + weight) norms are megatron's refusal
        assert torch.equal(norm.weight, torch.ones_like(norm.weight))
