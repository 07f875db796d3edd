"""What `MegatronModel` refuses, as upstream's Megatron class does: optimizers, schedulers and
calls it has no counterpart for, unsupported options and adapters, a vpp mesh; and the ddp
overlap switches reach the core model's options."""

import pytest
from test_class_api_megatron import LORA

from twinkle import DeviceMesh
from twinkle.model import MegatronModel
from twinkle_fn.testing import random_features, tiny_config


@pytest.fixture(scope="module")
def model():
    return MegatronModel(config=tiny_config(), mixed_precision="no")


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: m.set_optimizer("AdamW", lr=1e-3), "'default', 'MegatronDistributedOptimizer'"),
        (
            lambda m: m.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1),
            "'default', 'OptimizerParamScheduler'",
        ),
        (lambda m: m.forward(inputs=random_features(2)), "forward and backward together"),
        (lambda m: m.calculate_loss(), "forward and backward together"),
        (lambda m: m.backward(), "forward and backward together"),
        (lambda m: m.load("no-such-dir"), "does not exist"),
        (lambda m: m.get_state_dict(adapter_name="a"), "adapter 'a' does not exist"),
        (lambda m: m.set_optimizer("default", betas=(0.9, 0.9)), "not supported; known: lr"),
        (lambda m: m.clip_grad_and_step(max_grad_norm=0.5), "clip_grad=1.0"),
    ],
)
def test_bad_calls_raise_clear_errors(model, call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(model)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mixed_precision="fp8"), "mixed_precision must be one of"),
        (dict(ddp_config={"overlap_param_gather": "on"}), "overlap_param_gather='on'"),
        (dict(ddp_config={"grad_reduce_in_fp32": False}), "grad_reduce_in_fp32=False"),
        (dict(ddp_config={"overlap_grad_reduce": "yes"}), "overlap_grad_reduce='yes'"),
        (dict(config=None), "needs model_id"),
    ],
)
def test_unsupported_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MegatronModel(**{"config": tiny_config(), **kwargs})


def test_vpp_is_refused_by_the_device_mesh():
    with pytest.raises(ValueError, match="vpp_size=2"):
        DeviceMesh.from_sizes(world_size=2, pp_size=2, vpp_size=2)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (("a", "/tmp/adapter-dir"), {}, "not supported on MegatronModel yet"),
        (("a", LORA), dict(is_trainable=False), "is_trainable=False is not supported"),
        (("a", LORA), dict(gradient_accumulation_steps=-1), "positive int"),
        (("", LORA), {}, "non-empty str"),
        (("a", {"r": 4, "target_modules": ["q_proj"]}), {}, "fuses into one linear_qkv"),
    ],
)
def test_bad_adapters_are_refused(args, kwargs, match):
    model = MegatronModel(config=tiny_config(), mixed_precision="no")
    with pytest.raises(ValueError, match=match):
        model.add_adapter_to_model(*args, **kwargs)
    model.add_adapter_to_model("a", LORA)  # nothing was half-added
    with pytest.raises(ValueError, match="one LoRA adapter per model"):
        model.add_adapter_to_model("b", LORA)


@pytest.mark.parametrize("key", ["overlap_grad_reduce", "overlap_param_gather"])
@pytest.mark.parametrize("overlap", [True, False])
def test_ddp_config_overlaps_reach_the_core(key, overlap):
    model = MegatronModel(config=tiny_config(), ddp_config={key: overlap})
    assert model._model.options[key] is overlap
