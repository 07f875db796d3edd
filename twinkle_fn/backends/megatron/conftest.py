"""Shared fixtures of the megatron tests."""

import pytest
import torch.distributed as dist

from twinkle_fn.backends.megatron import parallel
from twinkle_fn.mesh import Mesh
from twinkle_fn.testing_dist import free_port


@pytest.fixture(scope="module")
def megatron_world():
    """One gloo process with megatron-core initialized for a one-rank mesh (CPU patch on)."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    parallel.initialize(Mesh(), seed=0)
    try:
        yield
    finally:
        parallel.destroy()
        dist.destroy_process_group()
