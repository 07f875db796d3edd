"""Upstream Twinkle's model classes over the functional core."""

from twinkle.model.megatron import MegatronModel
from twinkle.model.transformers import TransformersModel

__all__ = ["MegatronModel", "TransformersModel"]
