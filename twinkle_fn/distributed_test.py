import pytest
import torch
import torch.distributed as dist

from twinkle_fn import distributed
from twinkle_fn.testing_dist import spawn


def _ranks_after_init():
    # The harness already joined the group: init_distributed must reuse it.
    return distributed.init_distributed(), distributed.rank(), distributed.world_size()


def test_reuses_an_existing_group_on_every_rank():
    assert spawn(_ranks_after_init, 2) == [(0, 0, 2), (1, 1, 2)]


def test_no_environment_means_one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not dist.is_initialized()
    assert distributed.init_distributed() == 0
    assert distributed.world_size() == 1 and distributed.rank() == 0


def test_world_without_rank_is_named(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="RANK"):
        distributed.init_distributed()


def _gathered():
    r = distributed.rank()
    return distributed.gather_tensors({"w": torch.full((r + 1,), float(r), requires_grad=True)})


def test_gather_tensors_gives_every_rank_every_rank_tensors():
    for got in spawn(_gathered, 2):
        assert sorted(got) == [0, 1]
        assert torch.equal(got[0]["w"], torch.zeros(1)) and torch.equal(got[1]["w"], torch.ones(2))
        assert not got[1]["w"].requires_grad


def test_gather_tensors_on_one_process_is_a_detached_copy():
    w = torch.ones(2, requires_grad=True)
    got = distributed.gather_tensors({"w": w})
    assert list(got) == [0] and torch.equal(got[0]["w"], w) and not got[0]["w"].requires_grad
