"""`twinkle.initialize` in local mode records the settings and joins no process group, as
upstream: megatron's checkpoint writer starts a child by ``spawn`` that re-runs the script's
top-level ``initialize`` under the parent's torchrun environment, and that call must return."""

import multiprocessing
import socket

import pytest
import torch.distributed as dist

import twinkle
from twinkle import DeviceMesh


@pytest.fixture
def restore_settings():
    # initialize sets process-wide settings; give them back after the test. These tests are
    # about a script's first call, in a process that has joined no process group: initialize
    # takes a joined group's world over WORLD_SIZE, so a one-rank group that an earlier test on
    # this xdist worker left behind is taken down first.
    if dist.is_initialized():
        dist.destroy_process_group()
    before = twinkle.infra.settings()
    yield
    twinkle.infra._SETTINGS[0] = before


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rerun_top_level_initialize(results) -> None:
    # What a spawned child does when it re-imports the script: rank 0 of a 2-rank world whose
    # other rank never comes. Joining the group here would wait for it.
    twinkle.initialize(mode="local", global_device_mesh=DeviceMesh.from_sizes(dp_size=2))
    mesh = twinkle.infra.settings().device_mesh
    results.put((dist.is_initialized(), mesh.world_size, mesh.data_rank))


def test_initialize_in_a_spawned_child_returns_without_a_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_rerun_top_level_initialize, args=(results,))
    child.start()
    child.join(timeout=120)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail("initialize blocked in the spawned child (it joined a process group)")
    assert child.exitcode == 0
    assert results.get(timeout=5) == (False, 2, 0)


def test_initialize_takes_the_world_from_the_launcher_environment(monkeypatch, restore_settings):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    twinkle.initialize(mode="local", seed=3)
    mesh = twinkle.infra.settings().device_mesh
    assert mesh.world_size == 4 and mesh.data_rank == 3 and not dist.is_initialized()
    with pytest.raises(ValueError, match=r"has 2 ranks but torch\.distributed's world has 4"):
        twinkle.initialize(global_device_mesh=DeviceMesh.from_sizes(dp_size=2))


@pytest.mark.parametrize("raw", ["two", "0"])
def test_a_bad_world_size_environment_is_named(monkeypatch, restore_settings, raw):
    monkeypatch.setenv("WORLD_SIZE", raw)
    with pytest.raises(ValueError, match=rf"WORLD_SIZE='{raw}' is not a positive int"):
        twinkle.initialize(mode="local")
