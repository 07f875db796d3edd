"""twinkle: the class API (ModelScope Twinkle's) over the functional core `twinkle_fn`.

``from twinkle import DeviceMesh, initialize, remote_class, remote_function``; models in
`twinkle.model`, data in `twinkle.dataset`, `twinkle.dataloader`, `twinkle.template` and
`twinkle.processor`.
"""

from twinkle.device_mesh import DeviceMesh
from twinkle.infra import DeviceGroup, initialize, remote_class, remote_function

__version__ = "0.1.0"

__all__ = ["DeviceGroup", "DeviceMesh", "initialize", "remote_class", "remote_function"]
