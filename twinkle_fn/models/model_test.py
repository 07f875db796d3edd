import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from twinkle_fn import backends
from twinkle_fn.models import FAMILIES, from_hf_config, from_pretrained, resolve_model_dir
from twinkle_fn.testing import tiny_config


@pytest.mark.parametrize("family", FAMILIES)
def test_from_hf_config_builds_every_family(family):
    model = from_hf_config(tiny_config(family), seed=0, device="cpu")
    assert model.family == family and model.backend == "transformers"
    assert all(p.dtype == torch.float32 for p in model.module.parameters())


def test_seed_makes_init_deterministic():
    a = from_hf_config(tiny_config(), seed=1, device="cpu").module.state_dict()
    b = from_hf_config(tiny_config(), seed=1, device="cpu").module.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_config_dict_and_precision():
    model = from_hf_config(
        {"model_type": "llama", **tiny_config("llama").to_diff_dict()}, precision="bf16"
    )
    assert model.compute_dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"config": {"hidden_size": 8}}, "no 'model_type'"),
        ({"config": tiny_config(), "backend": "jax"}, "unknown backend 'jax'"),
        ({"config": tiny_config(), "precision": "fp8"}, "unknown precision 'fp8'"),
        (
            {"config": tiny_config(), "head": "critic"},
            "unknown head 'critic'; use one of lm, value",
        ),
    ],
)
def test_bad_input_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        from_hf_config(**kwargs)


def test_a_head_the_backend_does_not_build_is_refused_naming_one_that_does(monkeypatch):
    """Both backends build both heads today; a backend without one is refused before building."""
    monkeypatch.setattr(type(backends.get("megatron")), "heads", ("lm",))
    with pytest.raises(
        ValueError,
        match=r"backend='megatron' has no 'value' head; build this model with "
        r"backend='transformers'",
    ):
        from_hf_config(tiny_config(), head="value", backend="megatron")


def test_unknown_family_from_a_real_gpt2_config():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match=r"gpt2.*supports"):
        from_hf_config(GPT2Config(n_layer=1, n_embd=8, n_head=2))


def test_from_pretrained_round_trip(tmp_path):
    model = from_hf_config(tiny_config(), seed=0, device="cpu")
    model.module.save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path, device="cpu")
    ids = torch.randint(0, 96, (1, 5))
    torch.testing.assert_close(
        loaded.module(input_ids=ids).logits, model.module(input_ids=ids).logits
    )


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("family", "extra"),
    [(f, {}) for f in FAMILIES] + [("qwen2", {"tie_word_embeddings": True})],
    ids=[*FAMILIES, "qwen2-tied"],
)
def test_a_half_precision_checkpoint_loads_as_transformers_float32_load(
    tmp_path, monkeypatch, family, extra, stored
):
    """Read in the files' dtype and widened on the device, the module equals transformers' own
    ``dtype=torch.float32`` load bit for bit: every parameter and buffer, the computed
    non-persistent ones (gemma3's embedding scale) included, all float32; tied embeddings stay
    one parameter."""
    module = from_hf_config(tiny_config(family, **extra), seed=0, device="cpu").module
    module.to(stored).save_pretrained(tmp_path)
    read_as = []
    load = AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        read_as.append(kwargs["dtype"])
        return load(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
        ours = from_pretrained(tmp_path, device="cpu").module
    assert read_as == [stored]
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    got = {**dict(ours.named_parameters()), **dict(ours.named_buffers())}
    want = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert all(p.dtype == torch.float32 for p in ours.parameters())
    if extra:
        assert ours.get_output_embeddings().weight is ours.get_input_embeddings().weight


# Families transformers has a token-classification model for (a critic's body and head).
CRITICS = tuple(
    f for f in FAMILIES if type(tiny_config(f)) in AutoModelForTokenClassification._model_mapping
)


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - set(CRITICS)))
def test_a_value_head_on_a_family_without_token_classification_is_refused(family):
    with pytest.raises(ValueError, match=f"head='value' on model_type '{family}'"):
        from_hf_config(tiny_config(family), seed=0, device="cpu", head="value")


def test_the_families_without_a_critic_are_the_known_ones():
    assert set(FAMILIES) - set(CRITICS) == {
        "gemma3_text",
        "glm4_moe",
        "qwen3_5_text",
        "qwen3_5_moe_text",
    }


@pytest.mark.parametrize("family", CRITICS)
def test_a_value_head_is_one_scalar_per_token(family):
    """The causal LM's body under transformers' token-classification head with one label:
    ``score`` ``[hidden] -> 1`` initialised as verl's critic (weight N(0, 0.02), bias 0), no
    dropout, no lm_head."""
    model = from_hf_config(tiny_config(family), seed=0, device="cpu", head="value")
    assert model.head == "value" and model.module.get_output_embeddings() is None
    score = model.module.score
    assert score.weight.shape == (1, 32) and torch.equal(score.bias, torch.zeros(1))
    assert 0 < float(score.weight.abs().max()) < 5 * model.config.initializer_range
    assert model.module.dropout.p == 0.0
    ids = torch.randint(0, 96, (2, 5))
    assert model.module(input_ids=ids).logits.shape == (2, 5, 1)


def test_a_value_model_loads_the_body_of_a_causal_lm(tmp_path):
    lm = from_hf_config(tiny_config(), seed=0, device="cpu")
    lm.module.save_pretrained(tmp_path / "lm")
    critic = from_pretrained(tmp_path / "lm", device="cpu", head="value")
    body = critic.module.state_dict()
    for name, tensor in lm.module.state_dict().items():
        if name.startswith("model."):
            assert torch.equal(body[name], tensor), name
    assert torch.equal(critic.module.score.bias, torch.zeros(1))
    critic.module.save_pretrained(tmp_path / "critic")
    again = from_pretrained(tmp_path / "critic", device="cpu", head="value")
    assert torch.equal(again.module.score.weight, critic.module.score.weight)
    with pytest.raises(ValueError, match=r"holds a value model .*load it with head='value'"):
        from_pretrained(tmp_path / "critic", device="cpu")


def test_resolve_model_dir_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"config\.json"):
        resolve_model_dir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="could not download hf://org/missing"):
        resolve_model_dir("hf://org/missing")


def test_modelscope_ids_need_modelscope(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "modelscope", None)
    with pytest.raises(ValueError, match="needs the `modelscope` package"):
        resolve_model_dir("ms://org/name")


Q = "model.layers.0.self_attn.q_proj.weight"


def _edit(tensors, what):
    if what == "missing":
        del tensors["model.norm.weight"]
    elif what == "extra":
        tensors["model.layers.9.mlp.up_proj.weight"] = tensors[Q].clone()
    elif what == "shape":
        tensors[Q] = torch.zeros(48, 32)
    elif what == "nan":
        tensors[Q][1, 2] = float("nan")
    return tensors


DAMAGES = {
    "missing": r"lacks 1 tensors the model has, e.g. \['model.norm.weight'\]",
    "extra": r"holds 1 tensors the model lacks, e.g. \['model.layers.9.mlp.up_proj.weight'\]",
    "shape": rf"tensor '{Q}' has shape \(48, 32\) in .*model.safetensors, the model expects "
    r"\(32, 32\)",
    "nan": rf"tensor '{Q}' in .*model.safetensors holds NaN or infinity",
    "truncated": r"model.safetensors: tensor .* the file is truncated",
}


@pytest.mark.parametrize("what", list(DAMAGES))
def test_from_pretrained_refuses_a_damaged_directory_naming_tensor_and_file(tmp_path, what):
    """transformers itself would initialise a missing tensor at random and drop an extra one,
    with only a log line, and load NaN bytes as they are."""
    from safetensors.torch import load_file, save_file

    from_hf_config(tiny_config(), seed=0, device="cpu").module.save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    if what == "truncated":
        file.write_bytes(file.read_bytes()[:-64])
    else:
        save_file(_edit(load_file(file), what), file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=DAMAGES[what]):
        from_pretrained(tmp_path, device="cpu")
