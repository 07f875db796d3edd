import pytest
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
