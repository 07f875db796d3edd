"""twinkle: the class API (ModelScope Twinkle's) over the functional core `twinkle_fn`.

``from twinkle import DeviceMesh, initialize, remote_class, remote_function``; models in
`twinkle.model`, data in `twinkle.dataset`, `twinkle.dataloader`, `twinkle.template`,
`twinkle.preprocessor` and `twinkle.processor`; `get_logger`, `Platform`,
`get_device_placement` and `twinkle.hub` as upstream.
"""

from twinkle.device_mesh import DeviceMesh
from twinkle.infra import (
    DeviceGroup,
    get_device_placement,
    initialize,
    remote_class,
    remote_function,
)
from twinkle.logger import get_logger
from twinkle.platform import GPU, Platform

__version__ = "0.1.0"

__all__ = [
    "GPU",
    "DeviceGroup",
    "DeviceMesh",
    "Platform",
    "get_device_placement",
    "get_logger",
    "initialize",
    "remote_class",
    "remote_function",
]
