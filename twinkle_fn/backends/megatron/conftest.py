"""Shared fixtures of the megatron tests."""

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from twinkle_fn.backends.megatron import parallel
from twinkle_fn.mesh import Mesh
from twinkle_fn.testing import tiny_config
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


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """A function ``(family, **config overrides) -> (config, tensors)``: the tiny config
    (`twinkle_fn.testing.tiny_config`) and the tensors ``save_pretrained`` writes for a model
    built from it after ``torch.manual_seed(0)`` (the on-disk names), built once a session."""
    built = {}

    def checkpoint(name, **overrides):
        key = (name, repr(sorted(overrides.items())))  # overrides may hold lists
        if key not in built:
            cfg = tiny_config(name, **overrides)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg)
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            built[key] = (cfg, load_file(path / "model.safetensors"))
        return built[key]

    return checkpoint
