"""Shared fixtures of the end-to-end tests."""

import runpy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from twinkle_fn.testing_dist import spawn

COOKBOOK = Path(__file__).resolve().parent.parent / "cookbook"


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


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matrices: torch's intra-op threads only contend on a shared CPU (10x slower). A
    module asks for it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """`MegatronModel`'s spawned runs, one process then tp2 and pp2 (``_one_process`` and
    ``_two_ranks`` of ``test_class_api_megatron.py``): ``(reference, results, extra)`` of
    ``test_class_api_megatron.py`` and ``test_class_api_megatron_lora.py``, spawned once a
    session."""
    from test_class_api_megatron import MESHES, _one_process, _two_ranks

    out_dir = tmp_path_factory.mktemp("megatron_model")
    make = runpy.run_path(str(COOKBOOK / "make_tiny_model.py"))["make_tiny_model"]
    model_dir = make(out_dir / "tiny", hidden_size=32)
    reference, one, offloaded, lora, four_calls = spawn(
        _one_process, 1, str(model_dir), str(out_dir), timeout_s=300
    )[0]
    two = spawn(_two_ranks, 2, str(out_dir), timeout_s=300)
    results = {
        "one": [one],
        "offload": [offloaded],
        **{n: [r[n] for r in two] for n in MESHES if n != "one"},
    }
    extra = {
        "lora": lora,
        "four_calls": four_calls,
        "model_dir": model_dir,
        "resumed": [r["resumed"] for r in two],
        "weights_only": [r["weights_only"] for r in two],
    }
    return reference, results, extra
