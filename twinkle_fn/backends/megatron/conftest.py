"""Shared fixtures of the megatron tests."""

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from twinkle_fn.backends.megatron import parallel
from twinkle_fn.mesh import Mesh
from twinkle_fn.testing import tiny_config
from twinkle_fn.testing_dist import free_port, spawn


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


@pytest.fixture(scope="module")
def checkpoints(hf_checkpoint):
    """Per case of ``bridge_test.CASES``: the config and the tensors save_pretrained writes (the
    on-disk names); ``bridge_test`` and ``bridge_mcore_test`` read them."""
    from twinkle_fn.backends.megatron.bridge_test import CASES

    return {case: hf_checkpoint(case.split("-")[0], **CASES[case]) for case in CASES}


# The spawned worlds below are each checked by two test files: session-scoped, so that they are
# spawned once (megatron-core takes seconds to import in every rank, and they train many runs).
# A test module's own fixture of the same name (layer_compile_test's ``runs``) takes precedence.


@pytest.fixture(scope="session")
def one_process():
    """``backend_test._one_process`` on one spawned rank: ``(refs, checks)`` of ``backend_test``
    and ``backend_options_test``."""
    from twinkle_fn.backends.megatron.backend_test import _one_process

    return spawn(_one_process, 1, timeout_s=300)[0]


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory):
    """``backend_test._two_ranks`` on two spawned ranks, reading a saved qwen3_moe HF model:
    ``(weights_dir, per-rank results)`` of ``backend_test`` and ``backend_options_test``."""
    from twinkle_fn.backends.megatron.backend_test import _model, _two_ranks

    weights_dir = tmp_path_factory.mktemp("hf")
    _model("qwen3_moe", "transformers").module.save_pretrained(weights_dir)
    return weights_dir, spawn(_two_ranks, 2, weights_dir, timeout_s=300)


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """``dist_checkpoint_test._two_ranks`` on two spawned ranks: ``(root, per-rank results)`` of
    ``dist_checkpoint_test`` and ``dist_checkpoint_refusal_test``."""
    from twinkle_fn.backends.megatron.dist_checkpoint_test import _two_ranks

    root = tmp_path_factory.mktemp("megatron_ckpt")
    return root, spawn(_two_ranks, 2, root, timeout_s=300)
