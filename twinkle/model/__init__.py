"""Upstream Twinkle's model classes over the functional core."""

from twinkle.model.megatron import MegatronModel
from twinkle.model.transformers import TransformersModel
from twinkle.model.value import MegatronValueModel, TransformersValueModel

__all__ = ["MegatronModel", "MegatronValueModel", "TransformersModel", "TransformersValueModel"]
