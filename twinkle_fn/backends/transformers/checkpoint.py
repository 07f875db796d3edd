"""The transformers backend's checkpoint layout, inside a directory `twinkle_fn.checkpoint` makes.

The HF model files (``config.json``, ``*.safetensors``), so ``AutoModelForCausalLM.from_pretrained``
loads the directory (every floating tensor in float32, the dtype the module is built in: frozen
weights the backend stores in the compute dtype are upcast, exactly, so a checkpoint does not
depend on the precision it was trained in), plus ``twinkle_state.pt`` (step, RNG key, loss scale, trainable names, and on
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
from torch.distributed.tensor import DTensor
from transformers.core_model_loading import revert_weight_conversion

from twinkle_fn.backends.transformers.compute import bind
from twinkle_fn.backends.transformers.fp8_linears import dense_state, load_stored
from twinkle_fn.backends.transformers.fsdp import copy_into_shard, unshard
from twinkle_fn.backends.transformers.loss_scale import LossScale
from twinkle_fn.checkpoint import read_weights
from twinkle_fn.distributed import rank
from twinkle_fn.pytree import tree_flatten_with_path, tree_leaves
from twinkle_fn.state import TrainState
from twinkle_fn.tensor_specs import (
    TensorSpec,
    check_finite,
    check_specs,
    dcp_specs,
    module_specs,
    safetensors_specs,
)

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


def hf_specs(state: TrainState) -> tuple[dict[str, TensorSpec], frozenset[str]]:
    """The tensors `save` writes to the HF files of `state` (names as on disk: MoE experts one
    per expert; whole shapes; the parameters' dtypes), and the tied aliases a checkpoint may
    hold or omit."""
    module = state.model.module
    bind(module, state.params, sharded=state.model.placement is not None)
    specs, aliases = module_specs(module)
    meta = {n: torch.empty(s.shape, dtype=s.dtype, device="meta") for n, s in specs.items()}
    on_disk = revert_weight_conversion(module, _as_saved(meta))
    return {n: TensorSpec.of(t) for n, t in on_disk.items()}, aliases


def load(state: TrainState, directory: Path, manifest: Mapping[str, Any]) -> TrainState:
    """`state` filled from the checkpoint in `directory`: everything is read and checked
    (names, shapes, dtypes, finiteness) before the first element of `state` is written, so a
    refused checkpoint leaves `state` as it was.

    The HF files were checked against `hf_specs` by `twinkle_fn.checkpoint.load`. Raises
    ``ValueError`` when the checkpoint holds other trainable parameters, another optimizer's
    state, an optimizer tensor of another shape or dtype, or a tensor holding NaN or infinity.
    """
    saved = torch.load(directory / STATE_FILE, weights_only=True)
    if saved["trainable"] != sorted(state.params):
        raise ValueError(
            f"checkpoint {directory} was saved with other trainable parameters "
            f"({len(saved['trainable'])} vs {len(state.params)} in this state); "
            "load it into a state built from the same model and adapters"
        )
    opt = tree_flatten_with_path(state.opt_state)
    if [p for p, _ in opt] != saved["opt_paths"]:
        raise ValueError(
            f"checkpoint {directory} holds another optimizer's state; use the same transform as "
            "the save"
        )
    device = next(iter(state.params.values())).device
    weights = read_weights(directory)
    if not manifest["sharded"]:  # the parameters come from the HF files alone
        _require_params(state, weights, directory)
    check_finite(
        weights, where=f"checkpoint {directory}", files=safetensors_specs(directory), device=device
    )
    if manifest["sharded"]:
        sharded = _read_dcp(state, directory / DCP_DIR, device)
    else:
        leaves = dict(zip([p for p, _ in opt], saved["opt_leaves"], strict=True))
        check_specs(
            {
                p: TensorSpec(tuple(t.shape), t.dtype, directory / STATE_FILE)
                for p, t in leaves.items()
            },
            {p: TensorSpec.of(t) for p, t in opt},
            where=f"checkpoint {directory} (optimizer state)",
        )
        check_finite(leaves, where=f"checkpoint {directory}", device=device)
    # Everything is read and checked: from here on nothing refuses.
    _copy_module_weights(state, weights)
    if manifest["sharded"]:
        for dst, src in zip(tree_leaves(_dcp_state(state)), tree_leaves(sharded), strict=True):
            _copy_local(dst, src)
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
    own slice (no communication). The names and shapes were checked by
    `twinkle_fn.checkpoint.load_weights`; every tensor is read and checked to be finite before
    the first parameter is written.

    Raises ``ValueError`` naming a tensor that holds NaN or infinity.
    """
    saved = read_weights(directory, rename)
    _require_params(state, saved, directory)
    check_finite(
        {n: saved[n] for n in state.params},
        where=str(directory),
        files=safetensors_specs(directory, rename),
        device=next(iter(state.params.values())).device,
    )
    for name, p in state.params.items():
        copy_into_shard(p, saved[name].to(p.dtype))


def _require_params(state: TrainState, saved: Mapping[str, torch.Tensor], directory: Path) -> None:
    """Refuse HF weights that do not hold each trainable parameter under its module name: a
    family whose module fuses what its files keep apart (Qwen3-MoE's experts) is read back
    from the sharded checkpoint's ``dcp/`` only."""
    missing = [n for n in state.params if n not in saved]
    if missing:
        raise ValueError(
            f"{directory} does not hold these trainable parameters under the module's names: "
            f"{missing[:3]} (its files keep them in another layout, e.g. one tensor per "
            "expert); load a checkpoint saved from a sharded state, or start from "
            "tf.models.from_pretrained"
        )


def _read_dcp(state: TrainState, directory: Path, device: torch.device) -> dict[str, Any]:
    """The state's DCP tensors read into fresh tensors laid out like the state's own (sharded
    alike), after their names, whole shapes and dtypes were checked against the checkpoint's
    metadata; checked finite on every rank."""
    target = _dcp_state(state)
    expected = {
        f"{group}.{key}": TensorSpec.of(t) for group, d in target.items() for key, t in d.items()
    }
    check_specs(dcp_specs(directory), expected, where=f"checkpoint {directory}")
    scratch = {g: {k: torch.empty_like(t) for k, t in d.items()} for g, d in target.items()}
    dcp.load(scratch, checkpoint_id=directory)
    flat = {f"{g}.{k}": t for g, d in scratch.items() for k, t in d.items()}
    check_finite(flat, where=f"checkpoint {directory}", device=device)
    return scratch


def _copy_local(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src` into `dst`, two tensors laid out alike (a DTensor's local shard)."""
    with torch.no_grad():
        if isinstance(dst, DTensor):
            dst.to_local().copy_(src.to_local())
        else:
            dst.copy_(src)


def _dcp_state(state: TrainState) -> dict[str, dict[str, torch.Tensor]]:
    """What DCP saves and loads in place: parameters and optimizer-state leaves by path."""
    return {"params": dict(state.params), "opt": dict(tree_flatten_with_path(state.opt_state))}


def _full_state_dict(state: TrainState) -> dict[str, torch.Tensor]:
    """Every module tensor as a whole tensor, in HF names (a collective when sharded)."""
    module = state.model.module
    bind(module, state.params, sharded=state.model.placement is not None)
    return _as_saved(dict(dense_state(module, unshard(dict(module.state_dict())).items())))


def _as_saved(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` in the dtypes the HF files hold: bfloat16 / float16 ones (frozen weights stored
    in the compute dtype, see `twinkle_fn.backends.transformers.lora.store_frozen_in`) upcast to
    float32, as are the float8 specs of weights stored in float8 (whose values `dense_state`
    dequantises to float32 before they get here)."""
    low = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
    return {n: t.float() if t.dtype in low else t for n, t in tensors.items()}


def _copy_module_weights(state: TrainState, saved: Mapping[str, torch.Tensor]) -> None:
    """Copy every saved HF tensor into the module tensor of the same name (shards cut locally)."""
    module = state.model.module
    bind(module, state.params, sharded=state.model.placement is not None)
    own = dict(module.named_parameters())
    for name, tensor in saved.items():
        if name in own and not load_stored(module, name, tensor):
            copy_into_shard(own[name], tensor)
