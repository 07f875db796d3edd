"""Checkpoints of megatron-backend train states through megatron-core's ``dist_checkpointing``.

`save` writes, into a checkpoint directory that `twinkle_fn.checkpoint` prepares and renames
into place:

- ``megatron/``: a ``torch_dist`` (PyTorch DCP) checkpoint, every rank writing its own shards:
  the ``GPTModel``'s ``sharded_state_dict()``; the distributed optimizer's state in model space
  (per parameter, its fp32 main copy and Adam moments under the model tensor's sharding, keys
  ``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<model key>`` as megatron's
  ``fully_reshardable`` format names them), so it reshards over tp, pp, ep and dp on load;
  Adam's step and the fp16 grad scaler's state; each rank's RNG states; and the step, the
  schedule's update count and last lr (all ``megatron_optimizer``'s schedule reads), the
  state's RNG key and the mesh;
- the full HF weights (``model.safetensors`` + ``config.json``), gathered across tp / pp / ep by
  the backend's ``unshard``, so ``AutoModelForCausalLM.from_pretrained(dir)`` loads them.

A state that trains LoRA adapters saves what it trains: ``megatron/`` holds the adapters'
tensors alone (the frozen base weights are the model's own, loaded from its directory), with
their optimizer state, and the HF part is the peft adapter (``adapter_config.json``,
``adapter_model.safetensors``), so ``PeftModel.from_pretrained(hf_model, dir)`` loads it. It
loads back into a state built from the same model and LoRA config, on any mesh.

`load` restores model and optimizer on any mesh: megatron-core cuts each rank's shards out of
the saved tensors. RNG states (torch's CPU and CUDA generators, megatron's tracked tensor- and
expert-parallel streams) belong to one rank of one mesh: they are restored only when the state's
mesh equals the saved one; otherwise the new mesh's fresh ones are kept (a run resumed on another
mesh draws other dropout masks than an uninterrupted one would). Vocabulary tensors are padded
per tp rank (`twinkle_fn.backends.megatron.bridge_transforms`), so their saved rows may outnumber or fall
short of the loading mesh's; the rows both have are read, which hold every real token (the
padding rows are zeros throughout: no token selects them and the loss masks them).

The optimizer's state is laid out in model space by
`twinkle_fn.backends.megatron.dist_checkpoint_optimizer` (which says why megatron-core's own
``DistributedOptimizer.sharded_state_dict`` is not used).

megatron-core saves through a ``multiprocessing`` Manager (spawned): a script that saves needs an
``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing import ShardedObject
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
from torch import Tensor

from twinkle_fn.backends.megatron.dist_checkpoint_optimizer import (
    load_optimizer,
    optimizer_common,
    optimizer_params,
)
from twinkle_fn.backends.megatron.hf_weights import load_hf_weights
from twinkle_fn.backends.megatron.lora import adapter_state_dict
from twinkle_fn.backends.megatron.optimizer import MegatronOptState, refresh_slots
from twinkle_fn.backends.megatron.placement import MegatronPlacement, model_placement
from twinkle_fn.backends.megatron.safetensors_io import save_hf
from twinkle_fn.backends.megatron.sharding import checkpoint_names
from twinkle_fn.backends.megatron.weights import full_weights, settle
from twinkle_fn.lora import write_adapter_into
from twinkle_fn.mesh import Mesh
from twinkle_fn.state import TrainState
from twinkle_fn.tensor_specs import (
    TensorSpec,
    check_finite,
    check_specs,
    dcp_specs,
    module_specs,
)

DIST_DIR = "megatron"
FORMAT = 1
_RNG_KEY = "rng_state"


def save(state: TrainState, directory: str | Path) -> None:
    """Write `state`'s megatron checkpoint and its full HF weights into `directory`.

    A collective: every rank calls it with the same existing `directory`; rank 0 writes the
    HF files (the peft adapter, for a state that trains LoRA adapters). Raises ``ValueError``
    for a state whose optimizer is not `twinkle_fn.backends.megatron.megatron_optimizer`.
    """
    placement, opt = _checked(state)
    directory = Path(directory)
    target = directory / DIST_DIR
    if dist.get_rank() == 0:
        target.mkdir()
    dist.barrier()
    model = _trained(placement)
    sharded = {
        "model": model,
        "optimizer": {
            "params": optimizer_params(placement, opt, model, fill=True),
            "common": optimizer_common(opt),
        },
        _RNG_KEY: _rng_object(_rng_states()),
        "twinkle": {
            "format": FORMAT,
            "step": int(state.step),
            "rng": int(state.rng),
            "count": int(opt.count),
            "lr": float(opt.lr),
            "mesh": dataclasses.asdict(placement.mesh),
        },
    }
    dist_checkpointing.save(sharded, str(target), TorchDistSaveShardedStrategy())
    if placement.lora is not None:
        config, hf_config = placement.lora.config, placement.hf_config
        write_adapter_into(config, hf_config, adapter_state_dict(state), directory)
        return
    weights = full_weights(state)
    if dist.get_rank() == 0:
        save_hf(directory, weights.items(), placement.hf_config)


def load(state: TrainState, directory: str | Path) -> TrainState:
    """`state` with model, optimizer, step and RNG key -- and, on the mesh it was saved on, the
    RNG states -- read from `directory`; `state`'s tensors are overwritten in place (the caller
    donates it).

    A collective: every rank calls it. The checkpoint may come from another mesh. Raises
    ``ValueError`` for a directory without a megatron checkpoint or of another format, or a
    state `save` refuses; megatron-core's ``CheckpointingException`` when the checkpoint lacks
    a tensor this model has (another model).
    """
    placement, opt = _checked(state)
    target = Path(directory) / DIST_DIR
    if not dist_checkpointing.check_is_distributed_checkpoint(str(target)):
        raise ValueError(
            f"{directory} holds no megatron dist checkpoint ({DIST_DIR}/ is missing or "
            "incomplete); save one with tf.checkpoint.save from a megatron state"
        )
    meta = dist_checkpointing.load_common_state_dict(str(target))["twinkle"]
    if meta["format"] != FORMAT:
        raise ValueError(
            f"{directory}: megatron checkpoint format {meta['format']} is not {FORMAT}"
        )
    same_mesh = Mesh(**meta["mesh"]) == placement.mesh
    model = _trained(placement)
    sharded: dict[str, Any] = {
        # read into fresh tensors: the model's own are written only once all is checked
        "model": _scratch(model),
        "optimizer": {"params": optimizer_params(placement, opt, model, fill=False)},
    }
    _check_metadata(sharded, target)
    if same_mesh:
        sharded[_RNG_KEY] = _rng_object(None)
    loaded = dist_checkpointing.load(sharded, str(target), TorchDistLoadShardedStrategy())
    device = next(placement.module.parameters()).device
    tensors = dict(_tensors(loaded["model"]))
    tensors.update(_tensors(loaded["optimizer"]["params"], "optimizer."))
    check_finite(tensors, where=f"checkpoint {directory}", device=device)
    # Everything is read and checked: from here on nothing refuses.
    # with adapters, the frozen base weights are not in the checkpoint and stay as loaded
    placement.module.load_state_dict(loaded["model"], strict=placement.lora is None)
    load_optimizer(placement, opt, loaded["optimizer"])
    if same_mesh:
        _set_rng_states(loaded[_RNG_KEY])
    count = torch.tensor(meta["count"], dtype=torch.int64)
    lr = torch.tensor(meta["lr"], dtype=torch.float64)
    new_opt = refresh_slots(placement, dataclasses.replace(opt, count=count, lr=lr))
    return state.replace(
        opt_state=new_opt,
        step=torch.tensor(meta["step"], dtype=torch.int64),
        rng=torch.tensor(meta["rng"], dtype=torch.int64),
    )


def hf_specs(state: TrainState) -> tuple[dict[str, TensorSpec], frozenset[str]]:
    """What `save` writes to the HF files of `state`: HF checkpoint names (MoE experts one per
    expert) with whole shapes, in the megatron parameters' dtype, and the tied aliases a
    checkpoint may hold or omit; for a state that trains LoRA adapters, the peft adapter file's
    tensors (a collective: the adapter is gathered)."""
    placement = model_placement(state.model)
    if placement.lora is not None:
        adapter = adapter_state_dict(state)
        return {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in adapter.items()}, frozenset()
    specs, aliases = module_specs(state.model.module)
    meta = {n: torch.empty(s.shape, dtype=s.dtype, device="meta") for n, s in specs.items()}
    dtype = next(placement.module.parameters()).dtype
    on_disk = checkpoint_names(state.model, meta)
    return {n: TensorSpec(tuple(t.shape), dtype) for n, t in on_disk.items()}, aliases


def _trained(placement: MegatronPlacement) -> dict[str, Any]:
    """The module's sharded state dict; with LoRA adapters, their tensors alone (what the
    state trains: the base weights are frozen and come from the model's directory)."""
    model = placement.module.sharded_state_dict()
    if placement.lora is None:
        return model
    trained = {id(p) for p in placement.module.parameters() if p.requires_grad}
    kinds = ShardedTensor | ShardedTensorFactory
    return {k: v for k, v in model.items() if isinstance(v, kinds) and id(v.data) in trained}


def _scratch(model: dict[str, Any]) -> dict[str, Any]:
    """`model` (a sharded state dict) with every tensor's data replaced by a fresh one."""

    def fresh(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: fresh(v) for k, v in value.items()}
        if isinstance(value, ShardedTensor | ShardedTensorFactory):
            return dataclasses.replace(value, data=torch.empty_like(value.data))
        return value

    return fresh(model)


def _check_metadata(sharded: dict[str, Any], target: Path) -> None:
    """Refuse a checkpoint whose tensors lack, or differ in whole shape or dtype from, the
    sharded tensors a load of `sharded` reads (factories, built only at load, and tensors whose
    padded vocabulary rows may differ between meshes are checked by name alone)."""
    tensors, _ = extract_sharded_tensors_and_factories(sharded)
    found = dcp_specs(target)
    expected: dict[str, TensorSpec] = {}
    for sh in nested_values(tensors):
        if not isinstance(sh, ShardedTensor):
            continue
        spec = TensorSpec(tuple(sh.global_shape), sh.dtype)
        if sh.allow_shape_mismatch and sh.key in found:
            spec = TensorSpec(found[sh.key].shape, sh.dtype)
        expected[sh.key] = spec
    wanted = {k: v for k, v in found.items() if k in expected}
    check_specs(wanted, expected, where=f"checkpoint {target}")


def _tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
    """``(dotted key, tensor)`` of every tensor in the nested dict `tree`."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _tensors(value, f"{prefix}{key}.")
    elif isinstance(tree, Tensor):
        yield prefix.rstrip("."), tree


def load_weights(state: TrainState, directory: str | Path) -> None:
    """Copy the HF weights in `directory` into `state`'s megatron model, in place (this rank's
    slices, through the bridge, as a model is loaded), and refresh the distributed optimizer's
    fp32 main parameters from them, so that the next step starts from the loaded weights; the
    optimizer's moments and step stay."""
    placement = model_placement(state.model)
    settle(state.model)  # no gather may land on the loaded weights
    model = dataclasses.replace(state.model, weights_dir=Path(directory))
    load_hf_weights(placement.module, model, placement.mesh, placement.vocab_multiple)
    state.opt_state.optimizer.reload_model_params()


def _checked(state: TrainState) -> tuple[MegatronPlacement, MegatronOptState]:
    """`state`'s placement and optimizer state, if this module can checkpoint them, with the
    parameters settled (no all-gather in flight to be read or overwritten)."""
    placement = model_placement(state.model)
    if not isinstance(state.opt_state, MegatronOptState):
        raise ValueError(
            "checkpoints of megatron states need the state of "
            "twinkle_fn.backends.megatron.megatron_optimizer (a twinkle_fn.optim transform's "
            "state is not sharded the way megatron's dist_checkpointing expects); initialise "
            "the state with tf.init(model, megatron_optimizer(...), mesh)"
        )
    settle(state.model)
    return placement, state.opt_state


def _rng_object(states: dict[str, Any] | None) -> ShardedObject:
    """One shard per rank of a global object: this rank's RNG states."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return ShardedObject(_RNG_KEY, states, (world,), (rank,), replica_id=0)


def _rng_states() -> dict[str, Any]:
    states = {
        "cpu": torch.get_rng_state(),
        "tracker": dict(tensor_parallel.get_cuda_rng_tracker().get_states()),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["cpu"])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(dict(states["tracker"]))
