"""Whether Triton can be imported: the one check both of this project's kernels gate on."""

from __future__ import annotations

import functools
import importlib.util


@functools.cache
def available() -> bool:
    """True when the ``triton`` package is installed (it ships with torch's CUDA wheels).

    Cached: the loss and the optimizer ask on every step, and installing a package mid-run is
    not a case to pay a module search for.
    """
    return importlib.util.find_spec("triton") is not None
