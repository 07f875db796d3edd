import os

import pytest
import torch
import torch.distributed as dist

from twinkle_fn.testing_dist import spawn


def _all_reduce_rank():
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return dist.get_rank(), float(t)


def _fail_on_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 would wait here for ever: the harness must stop it
    return 0


def test_spawn_runs_real_ranks_and_collects_in_order():
    assert spawn(_all_reduce_rank, 2) == [(0, 3.0), (1, 3.0)]


def test_spawn_reraises_a_rank_failure():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 of 2 failed.*boom on purpose"):
        spawn(_fail_on_one, 2)


def test_a_rendezvous_port_taken_meanwhile_is_retried(monkeypatch):
    import socket

    from twinkle_fn import testing_dist

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real = testing_dist.free_port
    monkeypatch.setattr(testing_dist, "free_port", lambda: next(ports, None) or real())
    try:
        assert spawn(_all_reduce_rank, 2) == [(0, 3.0), (1, 3.0)]
    finally:
        taken.close()


def _environment_and_modules(name):
    import sys

    return os.environ.get(name), "megatron.core" in sys.modules


def test_each_rank_sees_the_callers_environment_of_now_and_no_megatron(monkeypatch):
    """Ranks fork from a server started at the first spawn: a variable set since then still
    reaches them, and none has megatron-core imported (it changes how tensors pickle) unless its
    function imports it."""
    spawn(_all_reduce_rank, 2)  # the fork server runs
    monkeypatch.setenv("TWINKLE_TESTING_DIST_PROBE", "now")
    assert spawn(_environment_and_modules, 2, "TWINKLE_TESTING_DIST_PROBE") == [("now", False)] * 2


def _seeds():
    import numpy

    return torch.initial_seed(), int(numpy.random.randint(2**31))


def test_each_rank_draws_its_own_seeds_as_a_fresh_interpreter_does():
    (torch_0, numpy_0), (torch_1, numpy_1) = spawn(_seeds, 2)
    assert torch_0 != torch_1 and numpy_0 != numpy_1
