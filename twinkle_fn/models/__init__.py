"""Model construction: HF configs and checkpoints of the supported families."""

from twinkle_fn.models.families import FAMILIES, family_of
from twinkle_fn.models.model import (
    Model,
    from_hf_config,
    from_pretrained,
    resolve_model_dir,
)

__all__ = [
    "FAMILIES",
    "Model",
    "family_of",
    "from_hf_config",
    "from_pretrained",
    "resolve_model_dir",
]
