"""The transformers backend's checkpoint layout, inside a directory `twinkle_fn.checkpoint` makes.

The HF model files (``config.json``, ``*.safetensors``), so ``AutoModelForCausalLM.from_pretrained``
loads the directory, plus ``twinkle_state.pt`` (step, RNG key, loss scale, trainable names, and on
one process the optimizer state). A sharded state (FSDP/TP) also writes ``dcp/``: parameters and
optimizer state through ``torch.distributed.checkpoint``, each rank writing its own shards, so the
checkpoint loads on another mesh (DCP reshards on load) or on one process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from twinkle_fn.backends.transformers.compute import bind
from twinkle_fn.backends.transformers.fsdp import copy_into_shard, unshard
from twinkle_fn.backends.transformers.loss_scale import LossScale
from twinkle_fn.checkpoint import read_weights
from twinkle_fn.distributed import rank
from twinkle_fn.pytree import tree_flatten_with_path, tree_leaves
from twinkle_fn.state import TrainState

STATE_FILE = "twinkle_state.pt"
DCP_DIR = "dcp"


def save(state: TrainState, directory: Path) -> dict[str, Any]:
    """Write the HF files, ``twinkle_state.pt`` and, for a sharded state, ``dcp/`` of `state`
    into `directory` (every rank calls it; rank 0 writes the shared files). Returns the
    manifest's ``{"sharded": ...}``."""
    sharded = state.model.placement is not None
    opt = tree_flatten_with_path(state.opt_state)
    if sharded:
        dcp.save(_dcp_state(state), checkpoint_id=directory / DCP_DIR)
    full = _full_state_dict(state)
    if rank() == 0:
        state.model.module.save_pretrained(directory, state_dict=full, safe_serialization=True)
        meta = {
            "opt_paths": [p for p, _ in opt],
            "step": state.step,
            "rng": state.rng,
            "loss_scale": None if state.loss_scale is None else tuple(state.loss_scale),
            "trainable": sorted(state.params),
        }
        if not sharded:
            meta["opt_leaves"] = [leaf for _, leaf in opt]
        torch.save(meta, directory / STATE_FILE)
    return {"sharded": sharded}


def load(state: TrainState, directory: Path, manifest: Mapping[str, Any]) -> TrainState:
    """`state` (taken: its buffers are overwritten) filled from the checkpoint in `directory`.

    Raises ``ValueError`` when the checkpoint holds other trainable parameters or another
    optimizer's state.
    """
    saved = torch.load(directory / STATE_FILE, weights_only=True)
    if saved["trainable"] != sorted(state.params):
        raise ValueError(
            f"checkpoint {directory} was saved with other trainable parameters "
            f"({len(saved['trainable'])} vs {len(state.params)} in this state); "
            "load it into a state built from the same model and adapters"
        )
    if [p for p, _ in tree_flatten_with_path(state.opt_state)] != saved["opt_paths"]:
        raise ValueError(
            f"checkpoint {directory} holds another optimizer's state; use the same transform as "
            "the save"
        )
    _load_module_weights(state, directory)
    if manifest["sharded"]:
        dcp.load(_dcp_state(state), checkpoint_id=directory / DCP_DIR)
    else:
        for dst, src in zip(tree_leaves(state.opt_state), saved["opt_leaves"], strict=True):
            copy_into_shard(dst, src)
    ls = saved.get("loss_scale")
    loss_scale = state.loss_scale if ls is None or state.loss_scale is None else LossScale(*ls)
    return state.replace(
        step=saved["step"].clone(), rng=saved["rng"].clone(), loss_scale=loss_scale
    )


def load_weights(
    state: TrainState, directory: Path, rename: Callable[[str], str] | None = None
) -> None:
    """Copy the tensors of the safetensors files in `directory` into the state's parameters, in
    place; each saved key goes through `rename` to a parameter name, and keys naming no
    trainable parameter (frozen base weights, buffers) are skipped. Sharded parameters get their
    own slice (no communication).

    Raises ``ValueError`` when `directory` has no safetensors file, lacks one of the state's
    parameters, or a shape differs.
    """
    saved = read_weights(directory, rename)
    missing = sorted(set(state.params) - set(saved))
    if missing:
        raise ValueError(
            f"{directory} lacks {len(missing)} trainable parameters, e.g. {missing[:3]}"
        )
    for name, p in state.params.items():
        if tuple(saved[name].shape) != tuple(p.shape):
            raise ValueError(
                f"{directory}: {name} has shape {tuple(saved[name].shape)}, the model "
                f"{tuple(p.shape)}"
            )
        copy_into_shard(p, saved[name].to(p.dtype))


def _dcp_state(state: TrainState) -> dict[str, dict[str, torch.Tensor]]:
    """What DCP saves and loads in place: parameters and optimizer-state leaves by path."""
    return {"params": dict(state.params), "opt": dict(tree_flatten_with_path(state.opt_state))}


def _full_state_dict(state: TrainState) -> dict[str, torch.Tensor]:
    """Every module tensor as a whole tensor, in HF names (a collective when sharded)."""
    module = state.model.module
    bind(module, state.params, sharded=state.model.placement is not None)
    return unshard(dict(module.state_dict()))


def _load_module_weights(state: TrainState, directory: Path) -> None:
    """Copy every saved HF tensor into the module tensor of the same name (shards cut locally)."""
    module = state.model.module
    bind(module, state.params, sharded=state.model.placement is not None)
    saved = read_weights(directory)
    own = dict(module.named_parameters())
    missing = [n for n in state.params if n not in saved]
    if missing:
        raise ValueError(f"checkpoint {directory} lacks trainable parameters: {missing[:5]}")
    for name, tensor in saved.items():
        if name in own:
            copy_into_shard(own[name], tensor)
