"""Model construction: HF configs and checkpoints of the supported families."""

from twinkle_fn.models.families import FAMILIES, Family, family, family_of, registered
from twinkle_fn.models.model import (
    Model,
    from_hf_config,
    from_pretrained,
    resolve_model_dir,
)

__all__ = [
    "FAMILIES",
    "Family",
    "Model",
    "family",
    "family_of",
    "from_hf_config",
    "from_pretrained",
    "registered",
    "resolve_model_dir",
]
