"""`MegatronModel`: upstream Twinkle's Megatron class, not part of this build yet."""

from __future__ import annotations

import os
from typing import Any

from twinkle.device_mesh import DeviceMesh
from twinkle.infra import remote_class
from twinkle_fn import backends


@remote_class(execute="all")
class MegatronModel:
    """Upstream's ``MegatronModel(model_id, config=None, device_mesh=None,
    mixed_precision='bf16', **kwargs)``; constructing it raises ``ValueError`` until the class
    API is built over the core's megatron backend. Use `twinkle.model.TransformersModel`."""

    def __init__(
        self,
        model_id: str | os.PathLike[str],
        config: Any = None,
        device_mesh: DeviceMesh | None = None,
        mixed_precision: str = "bf16",
        **kwargs: Any,
    ) -> None:
        if "megatron" not in backends.names():
            raise ValueError(
                "MegatronModel: the megatron backend is not available in this build; use "
                "TransformersModel (FSDP2/TP over the transformers backend)"
            )
        raise ValueError(
            "MegatronModel: the class API over the megatron backend is not built yet; use the "
            "functional API (twinkle_fn with backend='megatron') or TransformersModel"
        )
