"""Shared fixtures of the end-to-end tests."""

import pytest
import torch.distributed as dist


@pytest.fixture
def no_leak():
    """Take down the one-rank process group and the megatron state a one-process megatron run
    starts in this process: later tests on this xdist worker (tests/upstream_compat's
    initialize) read a joined group's world."""
    from twinkle_fn.backends.megatron import parallel

    had = dist.is_initialized()
    yield
    parallel.destroy()
    if dist.is_initialized() and not had:
        dist.destroy_process_group()
