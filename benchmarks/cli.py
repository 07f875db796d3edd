"""What the benchmarks' command lines share: the flag type of a positive count and the device a
``--device`` flag names."""

from __future__ import annotations

import argparse

import torch


def positive_int(text: str) -> int:
    """`text` as an int for ``argparse``; raises ``ArgumentTypeError`` unless it is >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def device_of(flag: str | None) -> torch.device:
    """The device of a ``--device`` flag: `flag`, else cuda when available, else cpu."""
    return torch.device(flag or ("cuda" if torch.cuda.is_available() else "cpu"))
