"""Ray mode end to end on a local Ray cluster: CPU actors joined by gloo.

One cluster for the module (`initialize(mode='ray')` once); 2-rank actor groups. `Probe` (at
module level, so the actors import it by name) checks its process group in its constructor and
answers with what each rank saw; `TransformersModel` on dp=2 actors must train as one process
on the same global batches (float32; they differ only in the order of a 2-way gradient sum).
"""

import os
import runpy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import twinkle
from twinkle import DeviceGroup, DeviceMesh, _ray_engine, remote_class, remote_function
from twinkle.data_format import ModelOutput
from twinkle.dataloader import DataLoader
from twinkle.infra import settings, shutdown
from twinkle.model import TransformersModel
from twinkle_fn.testing import random_features

ray = pytest.importorskip("ray", reason="ray mode needs the ray package (pip install twinkle[ray])")

COOKBOOK = Path(__file__).resolve().parent.parent / "cookbook"
SEED = 5


@remote_class()
class Probe:
    """A remote object whose constructor all-reduces over the actors' process group."""

    def __init__(self, scale: float, device_mesh: DeviceMesh | None = None, fail_on_rank=None):
        if dist.get_rank() == fail_on_rank:
            raise ValueError(f"constructor refused on rank {fail_on_rank}")
        self.device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        total = torch.tensor([float(dist.get_rank() + 1)], device=self.device)
        dist.all_reduce(total)  # the ranks wait here for one that failed above
        self.device_mesh, self.scale, self.rank_sum = device_mesh, scale, float(total)
        self.counted = 0
        self.seed_draw = float(torch.rand(()))

    def identity(self) -> dict:
        """Undecorated: every rank runs it, the handle returns rank 0's answer."""
        return self._identity()

    @remote_function(collect="none")
    def identities(self) -> dict:
        return self._identity()

    def _identity(self) -> dict:
        env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        return dict(
            rank=dist.get_rank(),
            world=dist.get_world_size(),
            backend=dist.get_backend(),
            env=env,
            data_rank=self.device_mesh.data_rank,
            rank_sum=self.rank_sum,
            seed_draw=self.seed_draw,
            twinkle_seed=twinkle.infra.settings().seed,
        )

    @remote_function(dispatch="all", collect="none")
    def all_reduce(self, value: float) -> float:
        t = torch.tensor([value * self.scale * (dist.get_rank() + 1)], device=self.device)
        dist.all_reduce(t)
        return float(t)

    @remote_function(dispatch="slice_dp", collect="flatten")
    def take(self, rows: list, tag: str = "") -> list:
        return [(dist.get_rank(), row, tag) for row in rows]

    @remote_function(dispatch="slice", collect="none")
    def take_slice(self, rows: list) -> list:
        return rows

    @remote_function(dispatch="slice_dp", collect="mean")
    def outputs(self, rows: list) -> ModelOutput:
        rank = dist.get_rank()
        return ModelOutput(
            loss=float(rank), num_tokens=len(rows), logps=torch.full((len(rows), rank + 1), 1.0)
        )

    @remote_function(collect="sum")
    def rank_plus(self, x: int) -> int:
        return dist.get_rank() + x

    @remote_function(execute="first")
    def count(self) -> tuple[int, int]:
        self.counted += 1
        return dist.get_rank(), self.counted

    @remote_function(collect="none")
    def counts(self) -> int:
        return self.counted

    @remote_function(collect="none")
    def fail(self, rank: int) -> int:
        if dist.get_rank() == rank:
            raise ValueError(f"probe refused on rank {rank}")
        return dist.get_rank()

    @remote_function(collect="none")
    def fail_in_collective(self, rank: int) -> float:
        if dist.get_rank() == rank:
            raise ValueError(f"probe refused on rank {rank}")
        return self.all_reduce(1.0)  # waits for the rank that failed

    @property
    def doubled(self) -> float:
        return 2 * self.scale


@pytest.fixture(scope="module")
def cluster():
    before = settings()
    groups = [
        DeviceGroup("probe", 2, device_type="CPU"),
        DeviceGroup("model", [0, 1], device_type="CPU"),
        DeviceGroup("loader", 1, device_type="CPU"),
    ]
    twinkle.initialize(mode="ray", groups=groups, seed=SEED, ncpu_proc_per_node=2)
    yield settings()
    shutdown()
    twinkle.infra._SETTINGS[0] = before


@pytest.fixture(scope="module")
def probe(cluster):
    return Probe(1.5, remote_group="probe")


def test_initialize_records_ray_mode(cluster):
    assert cluster.mode == "ray" and ray.is_initialized() and cluster.seed == SEED
    assert cluster.device_mesh.world_size == 2  # dp over the first group
    assert [g.name for g in cluster.groups] == ["probe", "model", "loader"]


def test_each_actor_is_one_rank_of_a_process_group(probe):
    ids = probe.identities()
    assert [i["rank"] for i in ids] == [0, 1] and [i["data_rank"] for i in ids] == [0, 1]
    for rank, info in enumerate(ids):
        assert info["world"] == 2 and info["backend"] == "gloo"
        assert info["env"]["RANK"] == str(rank) and info["env"]["WORLD_SIZE"] == "2"
        assert info["env"]["LOCAL_RANK"] == "0"
        assert info["rank_sum"] == 3.0  # 1 + 2, all-reduced in the constructor
        assert info["twinkle_seed"] == SEED
    assert ids[0]["env"]["MASTER_PORT"] == ids[1]["env"]["MASTER_PORT"]
    torch.manual_seed(SEED)
    assert ids[0]["seed_draw"] == ids[1]["seed_draw"] == float(torch.rand(()))
    assert probe.all_reduce(2.0) == [9.0, 9.0]  # 2 * 1.5 * (1 + 2) on both ranks


def test_the_handle_is_an_instance_with_remote_methods(probe):
    assert isinstance(probe, Probe) and type(probe).__name__ == "Probe"
    assert probe.identity() == probe.identities()[0]  # undecorated: rank 0's result
    assert probe.remote_group == "probe" and probe.device_mesh.world_size == 2
    assert "2 Ray actor(s) of group 'probe'" in repr(probe)
    assert type(probe).identity.__doc__.startswith("Undecorated")  # the method's own
    with pytest.raises(AttributeError, match=r"Probe\.doubled is not readable from a ray-mode"):
        _ = probe.doubled  # a property
    with pytest.raises(AttributeError, match=r"Probe\.scale is not readable from a ray-mode"):
        _ = probe.scale
    with pytest.raises(TypeError, match="cannot be pickled"):
        ray.put(probe)


def test_dispatch_and_collect_policies(probe):
    rows = list(range(5))
    assert probe.take(rows, tag="t") == [
        (0, 0, "t"),
        (0, 1, "t"),
        (0, 2, "t"),
        (1, 3, "t"),
        (1, 4, "t"),
    ]
    assert probe.take_slice(rows) == [[0, 1, 2], [3, 4]]
    out = probe.outputs(rows)
    assert type(out) is ModelOutput and out.loss == 0.5 and out.num_tokens == 5
    assert out.logps.shape == (5, 2) and out.logps[:3, 1].eq(0).all() and out.logps[3:].eq(1).all()
    assert probe.rank_plus(10) == 21
    before = probe.counts()
    assert probe.count() == (0, before[0] + 1)  # execute='first': rank 0 only, unwrapped
    assert probe.counts() == [before[0] + 1, before[1]]


def test_an_actors_exception_is_raised_in_the_driver(probe):
    with pytest.raises(ValueError, match="probe refused on rank 1") as info:
        probe.fail(1)
    text = str(info.value)
    assert "in fail" in text and "raise ValueError" in text  # the actor's traceback
    assert any("rank 1 of remote group 'probe'" in note for note in info.value.__notes__)
    assert probe.fail(-1) == [0, 1]  # the other rank finished: the object is still usable


def test_placement_errors_name_the_fix(cluster):
    with pytest.raises(ValueError, match=r"remote_group='nope' is not one of .*'probe'"):
        Probe(1.0, remote_group="nope")
    with pytest.raises(ValueError, match="device_mesh has 4 ranks but DeviceGroup 'probe' has 2"):
        Probe(1.0, DeviceMesh.from_sizes(dp_size=4), remote_group="probe")
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        Probe(1.0, colour="red", remote_group="probe")
    with pytest.raises(ValueError, match="DeviceGroup names must be unique"):
        twinkle.initialize(mode="ray", groups=[DeviceGroup("a", 1), DeviceGroup("a", 2)])
    with pytest.raises(ValueError, match="visible_devices is not supported"):
        twinkle.initialize(mode="ray", groups=[DeviceGroup("a", 1, visible_devices="0")])
    with pytest.raises(ValueError, match="needs 64 GPUs but the Ray cluster has"):
        twinkle.initialize(mode="ray", groups=[DeviceGroup("a", 64, device_type="GPU")])
    with pytest.raises(ValueError, match="needs groups="):
        twinkle.initialize(mode="ray")
    assert settings() == cluster  # a refused initialize changes nothing


def test_a_dataloader_iterates_in_its_own_actor(cluster):
    """execute='first': one actor with a one-rank mesh yields whole global batches, as the
    driver's own DataLoader in ray mode does."""
    rows = list(range(10))
    remote = DataLoader(rows, batch_size=4, remote_group="loader")
    local = DataLoader(rows, batch_size=4)
    assert len(remote) == len(local) == 3
    assert list(remote) == list(local) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert remote.get_state() == {"consumed_train_samples": 12}
    with pytest.raises(ValueError, match="batch_size must be a positive int") as info:
        DataLoader(rows, batch_size=0, remote_group="loader")  # raised by the actor's __init__
    assert "in __init__" in str(info.value) and "in construct" in str(info.value)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    make = runpy.run_path(str(COOKBOOK / "make_tiny_model.py"))["make_tiny_model"]
    return str(make(tmp_path_factory.mktemp("tiny") / "model", hidden_size=32))


def test_transformers_model_on_two_actors_trains_as_one_process(cluster, model_dir):
    """dp=2 actors (the global mesh) given each global batch: the same steps as one process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        remote = TransformersModel(model_id=model_dir, mixed_precision="no", remote_group="model")
        local = TransformersModel(
            model_id=model_dir, mixed_precision="no", device_mesh=DeviceMesh.from_sizes()
        )
        for model in (remote, local):
            # SGD: parameter differences stay those of the gradients (AdamW would blow the
            # last-bit differences of near-zero gradients up to the size of a step).
            model.set_optimizer("SGD", lr=0.5)
        feats = random_features(24, vocab_size=90, seed=3)
        losses = []
        for step in range(3):
            batch = feats[8 * step : 8 * (step + 1)]
            out, ref = remote.forward_backward(inputs=batch), local.forward_backward(inputs=batch)
            assert out.num_tokens == ref.num_tokens  # summed over the two halves
            norms = remote.clip_grad_and_step(max_grad_norm=1.0)  # collect='none': per rank
            ref_norm = local.clip_grad_and_step(max_grad_norm=1.0)
            assert norms[0] == norms[1] == pytest.approx(ref_norm, rel=1e-5)
            metric, ref_metric = remote.calculate_metric(), local.calculate_metric()
            assert metric["loss"] == pytest.approx(ref_metric["loss"], rel=1e-5)
            losses.append(metric["loss"])
        params, ref_params = remote.get_state_dict(), local.get_state_dict()
        assert params.keys() == ref_params.keys()
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=1e-5, atol=1e-6)
        out, ref = remote.forward_only(inputs=feats[:8]), local.forward_only(inputs=feats[:8])
        torch.testing.assert_close(out.logps, ref.logps)
        assert ref.loss < losses[0]  # the first batch, after 3 steps: it learned something
    finally:
        torch.set_num_threads(threads)


def test_a_rank_that_fails_while_others_wait_stops_the_group(probe, monkeypatch):
    """Runs after the other tests of `probe`: the group cannot be used after this."""
    monkeypatch.setattr(_ray_engine, "ERROR_GRACE_S", 1.0)
    with pytest.raises(ValueError, match="probe refused on rank 1") as info:
        probe.fail_in_collective(1)
    assert any("were stopped" in note for note in info.value.__notes__)
    with pytest.raises(RuntimeError, match=r"'probe' were stopped .*construct the object again"):
        probe.identities()


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)
def test_gpu_groups_join_over_nccl():
    before = settings()
    shutdown()
    try:
        twinkle.initialize(mode="ray", groups=[DeviceGroup("gpu", 2, device_type="GPU")])
        gpu = Probe(1.0, remote_group="gpu")
        assert [i["backend"] for i in gpu.identities()] == ["nccl", "nccl"]
        assert gpu.all_reduce(1.0) == [3.0, 3.0]
    finally:
        shutdown()
        twinkle.infra._SETTINGS[0] = before
