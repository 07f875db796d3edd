"""Save and load a `TrainState` as a directory that transformers can also load.

Layout: the HF model files (``config.json``, ``*.safetensors``; the tokenizer when given), so
``AutoModelForCausalLM.from_pretrained(dir)`` works, plus ``twinkle_state.pt`` (step, RNG key,
names, and on one process the optimizer state) and ``twinkle_manifest.json``. A sharded state
(FSDP/TP) also writes ``dcp/``: parameters and optimizer state through
``torch.distributed.checkpoint``, each rank writing its own shards, so a checkpoint loads on
another mesh (DCP reshards on load) or on one process.

A megatron-backend state is written by `twinkle_fn.megatron.dist_checkpoint` instead: the same
HF files (gathered across tp / pp / ep) plus ``megatron/``, megatron-core's ``dist_checkpointing``
of model, optimizer and RNG states, which loads on another tp / pp / dp mesh.

A save writes into a temporary sibling directory and renames it into place only once the
manifest is written, so an interrupted save never leaves a directory that `load` accepts.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from twinkle_fn.backends.fsdp import copy_into_shard, unshard
from twinkle_fn.backends.hf import bind
from twinkle_fn.distributed import rank, world_size
from twinkle_fn.loss_scale import LossScale
from twinkle_fn.pytree import tree_flatten_with_path, tree_leaves
from twinkle_fn.state import TrainState

MANIFEST = "twinkle_manifest.json"
STATE_FILE = "twinkle_state.pt"
DCP_DIR = "dcp"
FORMAT = 1


def save(
    state: TrainState,
    path: str | os.PathLike[str],
    *,
    tokenizer: Any = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write `state` (and `tokenizer`, and JSON-able `extra`) to the directory `path`.

    On several ranks every rank must call it (it gathers the HF weights and writes its own
    shards); rank 0 writes the rest. An existing checkpoint at `path` is replaced only after the
    new one is complete. Returns the path. Raises ``DonatedError`` for a donated state,
    ``TypeError`` for non-JSON `extra`, and for a megatron state ``ValueError`` as
    `twinkle_fn.megatron.dist_checkpoint.save` does.
    """
    state.check_alive()
    path = Path(path)
    extra = extra or {}
    json.dumps(extra)
    megatron = state.model.backend == "megatron"
    sharded = megatron or state.model.placement is not None
    writer = rank() == 0
    tmp = path.parent / f".{path.name}.tmp-{_shared_token()}"
    try:
        if writer:
            tmp.mkdir(parents=True)
        _barrier()
        if megatron:
            _dist_checkpoint().save(state, tmp)
        else:
            _save_fsdp(state, tmp, sharded, writer)
        if writer:
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            manifest = {"format": FORMAT, "step": int(state.step), "extra": extra}
            manifest.update(sharded=sharded, backend=state.model.backend)
            _write_json(tmp / MANIFEST, manifest)
            replace_dir(tmp, path)
        _barrier()
    except BaseException:
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _save_fsdp(state: TrainState, tmp: Path, sharded: bool, writer: bool) -> None:
    """The HF files, ``twinkle_state.pt`` and, for a sharded state, ``dcp/`` of `state`."""
    opt = tree_flatten_with_path(state.opt_state)
    if sharded:
        dcp.save(_dcp_state(state), checkpoint_id=tmp / DCP_DIR)
    full = _full_state_dict(state)
    if writer:
        state.model.module.save_pretrained(tmp, state_dict=full, safe_serialization=True)
        meta = {
            "opt_paths": [p for p, _ in opt],
            "step": state.step,
            "rng": state.rng,
            "loss_scale": None if state.loss_scale is None else tuple(state.loss_scale),
            "trainable": sorted(state.params),
        }
        if not sharded:
            meta["opt_leaves"] = [leaf for _, leaf in opt]
        torch.save(meta, tmp / STATE_FILE)


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether `path` holds a checkpoint whose save finished."""
    return (Path(path) / MANIFEST).is_file()


def read_extra(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``extra`` dict saved with the checkpoint at `path`."""
    return _manifest(Path(path))["extra"]


def load(state: TrainState, path: str | os.PathLike[str], *, donate: bool = True) -> TrainState:
    """`state` with parameters, optimizer state, step and RNG key read from `path`.

    `state` provides the structure (module, optimizer transform, mesh), which may differ from
    the mesh the checkpoint was saved on. With ``donate=True`` its buffers are overwritten in
    place and it is consumed; ``donate=False`` (one process only) fills a copy. On several ranks
    every rank must call it. Raises ``ValueError`` for an incomplete or incompatible checkpoint
    (missing manifest, another backend's state, other trainable parameters, another optimizer's
    state); a megatron state also as `twinkle_fn.megatron.dist_checkpoint.load` does.
    """
    path = Path(path)
    manifest = _manifest(path)
    _check_backend(state, manifest, path)
    if state.model.backend == "megatron":
        if not donate:
            raise ValueError(
                "load(donate=False) copies the state, which a megatron model cannot do"
            )
        new = state.replace()
        state.donate("checkpoint.load")
        return _dist_checkpoint().load(new, path)
    saved = torch.load(path / STATE_FILE, weights_only=True)
    if saved["trainable"] != sorted(state.params):
        raise ValueError(
            f"checkpoint {path} was saved with other trainable parameters "
            f"({len(saved['trainable'])} vs {len(state.params)} in this state); "
            "load it into a state built from the same model and adapters"
        )
    if [p for p, _ in tree_flatten_with_path(state.opt_state)] != saved["opt_paths"]:
        raise ValueError(
            f"checkpoint {path} holds another optimizer's state; use the same transform as the save"
        )
    if donate:
        new = state.replace()
        state.donate("checkpoint.load")
    elif state.model.placement is not None:
        raise ValueError("load(donate=False) copies the state, which a sharded model cannot do")
    else:
        new = state.copy()
    _load_weights(new, path)
    if manifest["sharded"]:
        dcp.load(_dcp_state(new), checkpoint_id=path / DCP_DIR)
    else:
        for dst, src in zip(tree_leaves(new.opt_state), saved["opt_leaves"], strict=True):
            copy_into_shard(dst, src)
    ls = saved.get("loss_scale")
    loss_scale = new.loss_scale if ls is None or new.loss_scale is None else LossScale(*ls)
    return new.replace(step=saved["step"].clone(), rng=saved["rng"].clone(), loss_scale=loss_scale)


def _check_backend(state: TrainState, manifest: dict[str, Any], path: Path) -> None:
    saved = manifest.get("backend", "fsdp")  # checkpoints before megatron's have no backend
    if saved != state.model.backend:
        raise ValueError(
            f"checkpoint {path} holds a {saved!r} train state, which a {state.model.backend!r} "
            f"state cannot load; start from its HF weights instead: "
            f"tf.models.from_pretrained({str(path)!r}, backend={state.model.backend!r})"
        )


def _dist_checkpoint() -> Any:
    """`twinkle_fn.megatron.dist_checkpoint`, imported on first use (megatron-core is heavy)."""
    from twinkle_fn.megatron import dist_checkpoint

    return dist_checkpoint


def _dcp_state(state: TrainState) -> dict[str, dict[str, torch.Tensor]]:
    """What DCP saves and loads in place: parameters and optimizer-state leaves by path."""
    return {"params": dict(state.params), "opt": dict(tree_flatten_with_path(state.opt_state))}


def _full_state_dict(state: TrainState) -> dict[str, torch.Tensor]:
    """Every module tensor as a whole tensor, in HF names (a collective when sharded)."""
    module = state.model.module
    bind(module, state.params, sharded=state.model.placement is not None)
    return unshard(dict(module.state_dict()))


def _load_weights(state: TrainState, path: Path) -> None:
    """Copy every saved HF tensor into the module tensor of the same name (shards cut locally)."""
    module = state.model.module
    bind(module, state.params, sharded=state.model.placement is not None)
    saved: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        saved.update(load_file(f))
    own = dict(module.named_parameters())
    missing = [n for n in state.params if n not in saved]
    if missing:
        raise ValueError(f"checkpoint {path} lacks trainable parameters: {missing[:5]}")
    for name, tensor in saved.items():
        if name in own:
            copy_into_shard(own[name], tensor)


def _shared_token() -> str:
    """A random token that every rank agrees on (rank 0's)."""
    token = [uuid.uuid4().hex[:8]]
    if world_size() > 1:
        dist.broadcast_object_list(token, src=0)
    return token[0]


def _barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def _manifest(path: Path) -> dict[str, Any]:
    if not is_complete(path):
        raise ValueError(
            f"{path} is not a complete twinkle checkpoint (no {MANIFEST}); "
            "its save was interrupted or it was written by another tool"
        )
    manifest = json.loads((path / MANIFEST).read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {manifest.get('format')} is not {FORMAT}")
    return manifest


def _write_json(file: Path, obj: Any) -> None:
    with open(file, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def replace_dir(src: Path, dst: Path) -> None:
    """Move the finished directory `src` to `dst`, replacing an older one only after the move
    (so a reader never finds `dst` half-written)."""
    old = None
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
