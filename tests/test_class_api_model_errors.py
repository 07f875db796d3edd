"""`TransformersModel`'s refusals and options: bad calls, adapter misuse and unsupported options
raise clear errors, expert-parallel switches are checked against the mesh, and ``fp8=`` reaches
the core model's options."""

import pytest
from test_class_api_model import CHATS, LORA, _model, _trained

from twinkle.model import MegatronModel, TransformersModel
from twinkle_fn.testing import random_features, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m: m.set_optimizer("Lion"), "unknown optimizer 'Lion'; known: AdamW"),
        (lambda m: m.set_lr_scheduler("StepLR", step_size=2), "unknown lr scheduler.*Cosine"),
        (lambda m: m.set_loss("GSPOLoss"), "GSPOLoss.*not available.*sequence-level"),
        (lambda m: m.set_loss("GRPOLoss", ignore_index=0), "ignore_index must be -100"),
        (lambda m: m.set_optimizer("AdamW", adapter_name="nope"), "adapter 'nope' does not exist"),
        (lambda m: m.forward_backward(inputs=random_features(1), adapter_name="x"), "'x' does not"),
        (lambda m: m.forward_backward(inputs=[]), "empty"),
        (lambda m: m.backward(), "forward"),
        (lambda m: m.forward_backward(inputs=CHATS), "set_template"),
    ],
)
def test_bad_calls_raise_clear_errors(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(_model())


def test_clip_with_norm_type_other_than_two_is_refused():
    model = _model()
    model.forward_backward(inputs=random_features(1))
    with pytest.raises(ValueError, match="L2"):
        model.clip_grad_norm(norm_type=1)


def test_adapter_errors():
    model = _model()
    model.add_adapter_to_model("a", LORA)
    with pytest.raises(ValueError, match=r"adapter 'a' already exists \(adapters: \['a'\]\)"):
        model.add_adapter_to_model("a", LORA)
    model.add_adapter_to_model("b", LORA)
    with pytest.raises(
        ValueError, match=r"'c' does not exist; this model has adapters \['a', 'b'\]"
    ):
        model.forward_backward(inputs=random_features(1), adapter_name="c")
    with pytest.raises(ValueError, match="full-parameter group ''"):
        model.set_optimizer("AdamW", adapter_name="")
    model.set_optimizer("AdamW", adapter_name="a")
    started = _trained(steps=1)
    with pytest.raises(ValueError, match="before the first forward"):
        started.add_adapter_to_model("a", LORA)
    with pytest.raises(ValueError, match="not a peft adapter directory"):
        _model().add_adapter_to_model("a", "/nonexistent")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mixed_precision": "fp8"}, "mixed_precision"),
        ({"grad_scaler_config": {"init_scale": 2.0}}, "grad_scaler_config"),
        ({"ddp_config": {"find_unused_parameters": True}}, "ddp_config"),
        ({"strategy": "deepspeed"}, "strategy"),
        ({"fsdp_config": {"cpu_offload": True}}, "cpu_offload"),
        ({"fsdp_config": {"expert_parallel": {"ep_size": 2}}}, r"'expert_parallel'\] keys"),
        ({"fsdp_config": {"expert_parallel": {"router_dtype": "bf16"}}}, "router_dtype.*'fp32'"),
        ({"fsdp_config": {"expert_parallel": {"enabled": "yes"}}}, r"\['enabled'\] must be a bool"),
        ({"model_cls": "AutoModelForSequenceClassification"}, "causal LM"),
        ({"hidden_sizes": 3}, "unknown TransformersModel arguments"),
    ],
)
def test_unsupported_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TransformersModel(config=tiny_config(), **kwargs)


def test_expert_parallel_switches_take_upstream_clis_ints():
    """``--enable-ep 1`` reaches ``enabled`` as the int 1 through upstream's CLI."""
    from twinkle import DeviceMesh
    from twinkle.model._build import check_expert_parallel, check_options

    options = {"expert_parallel": {"enabled": 1, "keep_router_logits": 0}}
    args = ("AutoModelForCausalLM", "native_fsdp", None)
    assert check_options(*args, options, None) == options
    check_expert_parallel(options, DeviceMesh.from_sizes(dp_size=2, ep_size=2))
    with pytest.raises(ValueError, match=r"\['enabled'\] must be a bool \(or 0 / 1\), got 2"):
        check_options(*args, {"expert_parallel": {"enabled": 2}}, None)


def test_expert_parallel_disabled_on_an_ep_mesh_is_refused():
    from twinkle import DeviceMesh
    from twinkle.model._build import check_expert_parallel

    mesh = DeviceMesh.from_sizes(dp_size=2, ep_size=2)
    with pytest.raises(ValueError, match="enabled'\\]=False with a mesh of ep_size=2"):
        check_expert_parallel({"expert_parallel": {"enabled": False}}, mesh)
    check_expert_parallel({"expert_parallel": {"enabled": True}}, mesh)
    check_expert_parallel({}, mesh)


def test_mesh_must_match_the_world_and_a_source_is_needed():
    from twinkle import DeviceMesh

    with pytest.raises(ValueError, match="world has 1"):
        TransformersModel(config=tiny_config(), device_mesh=DeviceMesh.from_sizes(fsdp_size=2))
    with pytest.raises(ValueError, match="model_id"):
        TransformersModel()


def test_megatron_model_refuses_a_missing_model_dir_clearly():
    with pytest.raises(ValueError, match=r"not a directory with a config\.json"):
        MegatronModel(model_id="/nonexistent")


def test_fp8_is_the_core_model_option():
    """``fp8=`` reaches the core model's option (checked and applied by the backend at the first
    state); ``mixed_precision='fp8'`` stays refused above: the compute dtype is another knob."""
    assert TransformersModel(config=tiny_config(), fp8="rowwise")._model.options == {
        "fp8": "rowwise"
    }
    assert TransformersModel(config=tiny_config())._model.options == {}
    stored = TransformersModel(config=tiny_config(), fp8="tensorwise", fp8_store_frozen=True)
    assert stored._model.options == {"fp8": "tensorwise", "fp8_store_frozen": True}
