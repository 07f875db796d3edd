"""The process-wide settings of `twinkle.infra.initialize`, and the device groups they name.

Upstream's API is module-level (``twinkle.initialize(...)``, then constructors pick up the
global mesh), so this module keeps the one piece of process-wide state that the API implies:
the settings of the last `initialize` call, in `_SETTINGS` (a one-item list, replaced in place
so that every module that imported it sees the change). `seed_everything` seeds a process as
those settings say (the driver, and each Ray actor).
"""

from __future__ import annotations

import dataclasses
import random

import torch

from twinkle.device_mesh import DeviceMesh

DEFAULT_SEED = 42


@dataclasses.dataclass(frozen=True)
class DeviceGroup:
    """A named set of ranks: where Ray mode places the objects built with ``remote_group=name``.

    `ranks`: a count or a list of ranks (one actor each); `device_type`: 'CPU', 'GPU' or None
    (GPUs when the cluster has them); `gpus_per_worker`: GPUs per actor. Recorded in local mode.
    """

    name: str
    ranks: list[int] | int
    device_type: str | None = None
    gpus_per_worker: int = 1
    visible_devices: str | None = None


@dataclasses.dataclass(frozen=True)
class Settings:
    """What `initialize` set: the mode, the global mesh, the seed, the device groups, and
    whether it started the Ray cluster (so that `shutdown` ends it)."""

    mode: str = "local"
    device_mesh: DeviceMesh | None = None
    seed: int = DEFAULT_SEED
    groups: tuple[DeviceGroup, ...] = ()
    full_determinism: bool = False
    ray_started: bool = False


_SETTINGS: list[Settings] = [Settings()]


def settings() -> Settings:
    """The settings of the last `initialize` call (defaults before any)."""
    return _SETTINGS[0]


def seed_everything(seed: int | None, full_determinism: bool) -> None:
    """Seed ``random`` and torch with `seed` (None: leave them), and with `full_determinism`
    turn on torch's deterministic algorithms."""
    if seed is not None:
        random.seed(seed)
        torch.manual_seed(seed)
    if full_determinism:
        torch.use_deterministic_algorithms(True)
