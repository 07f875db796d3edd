"""`TrainableModel`: the methods both model classes share are defined once, keep their
``remote_function`` policy on each subclass (the Ray engine's handles find inherited methods),
and a subclass's refusals come from its one table."""

import re

import pytest

from twinkle import _ray_engine
from twinkle.model import MegatronModel, TransformersModel
from twinkle.model._base import TrainableModel

SHARED = (
    "add_adapter_to_model",
    "calculate_metric",
    "clip_grad_and_step",
    "get_state_dict",
    "get_train_configs",
    "load",
    "lr_step",
    "resume_from_checkpoint",
    "save",
    "set_loss",
    "set_processor",
    "set_template",
    "step",
    "zero_grad",
)


@pytest.mark.parametrize("cls", [TransformersModel, MegatronModel])
def test_ray_handles_dispatch_inherited_methods_by_their_policy(cls):
    handle = _ray_engine.handle_class(cls)
    assert issubclass(handle, cls) and issubclass(handle, TrainableModel)
    for name in SHARED:
        base = TrainableModel.__dict__[name]
        assert getattr(cls, name) is base, name  # defined once, in the base
        remote = handle.__dict__[name]
        assert remote.__wrapped__ is base
        assert remote.__twinkle_remote__ == base.__twinkle_remote__
    # A subclass's own methods keep theirs.
    assert handle.__dict__["forward_backward"].__twinkle_remote__.dispatch == "slice_dp"
    assert handle.__dict__["calculate_metric"].__twinkle_remote__.collect == "first"


def test_the_base_is_not_a_model_by_itself():
    with pytest.raises(TypeError, match="abstract"):
        TrainableModel(None, None, "no", {})


def test_refusals_come_from_the_class_table():
    model = object.__new__(MegatronModel)  # the table needs no built model
    for feature, why in MegatronModel._REFUSED.items():
        with pytest.raises(ValueError, match=f"^{re.escape(f'context: {why}')}$"):
            model._check_supported(feature, "context")
    TrainableModel._check_supported(model, "a feature nobody refuses", "context")
    assert TransformersModel._REFUSED == {}
