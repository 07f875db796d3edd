"""Save and load a `TrainState` as a directory that transformers can also load.

Layout of a checkpoint directory: the HF model files (``config.json``, ``*.safetensors``, and the
tokenizer when given), so ``AutoModelForCausalLM.from_pretrained(dir)`` works, plus
``twinkle_state.pt`` (optimizer state, step, RNG key, user extras) and ``twinkle_manifest.json``.

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
from safetensors.torch import load_file

from twinkle_fn.backends.hf import bind
from twinkle_fn.pytree import tree_flatten_with_path, tree_leaves, tree_structure, tree_unflatten
from twinkle_fn.state import TrainState

MANIFEST = "twinkle_manifest.json"
STATE_FILE = "twinkle_state.pt"
FORMAT = 1


def save(
    state: TrainState,
    path: str | os.PathLike[str],
    *,
    tokenizer: Any = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write `state` (and `tokenizer`, and JSON-able `extra`) to the directory `path`.

    An existing checkpoint at `path` is replaced only after the new one is complete. Returns the
    path. Raises ``DonatedError`` for a donated state and ``TypeError`` for non-JSON `extra`.
    """
    state.check_alive()
    path = Path(path)
    extra = extra or {}
    json.dumps(extra)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        module = state.model.module
        bind(module, state.params, sharded=state.model.placement is not None)
        module.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        opt = tree_flatten_with_path(state.opt_state)
        torch.save(
            {
                "opt_paths": [p for p, _ in opt],
                "opt_leaves": [leaf for _, leaf in opt],
                "step": state.step,
                "rng": state.rng,
                "trainable": sorted(state.params),
            },
            tmp / STATE_FILE,
        )
        _write_json(tmp / MANIFEST, {"format": FORMAT, "step": int(state.step), "extra": extra})
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether `path` holds a checkpoint whose save finished."""
    return (Path(path) / MANIFEST).is_file()


def read_extra(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``extra`` dict saved with the checkpoint at `path`."""
    return _manifest(Path(path))["extra"]


def load(state: TrainState, path: str | os.PathLike[str], *, donate: bool = True) -> TrainState:
    """`state` with parameters, optimizer state, step and RNG key read from `path`.

    `state` provides the structure (module, optimizer transform, mesh); with ``donate=True`` its
    buffers are overwritten in place and it is consumed, otherwise a copy is filled. Raises
    ``ValueError`` for an incomplete or incompatible checkpoint (missing manifest, other
    trainable parameters, another optimizer's state).
    """
    path = Path(path)
    _manifest(path)
    saved = torch.load(path / STATE_FILE, weights_only=True)
    if saved["trainable"] != sorted(state.params):
        raise ValueError(
            f"checkpoint {path} was saved with other trainable parameters "
            f"({len(saved['trainable'])} vs {len(state.params)} in this state); "
            "load it into a state built from the same model and adapters"
        )
    if donate:
        new = state.replace()
        state.donate("checkpoint.load")
    else:
        new = state.copy()
    _load_weights(new, path)
    opt_leaves = tree_leaves(new.opt_state)
    opt_paths = [p for p, _ in tree_flatten_with_path(new.opt_state)]
    if opt_paths != saved["opt_paths"]:
        raise ValueError(
            f"checkpoint {path} holds another optimizer's state; use the same transform as the save"
        )
    with torch.no_grad():
        for dst, src in zip(opt_leaves, saved["opt_leaves"], strict=True):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
    opt_state = tree_unflatten(tree_structure(new.opt_state), opt_leaves)
    return new.replace(opt_state=opt_state, step=saved["step"].clone(), rng=saved["rng"].clone())


def _load_weights(state: TrainState, path: Path) -> None:
    """Copy every saved tensor into the module parameter of the same name (state's params bound)."""
    module = state.model.module
    bind(module, state.params, sharded=state.model.placement is not None)
    saved: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        saved.update(load_file(f))
    own = dict(module.named_parameters())
    missing = [n for n in state.params if n not in saved]
    if missing:
        raise ValueError(f"checkpoint {path} lacks trainable parameters: {missing[:5]}")
    with torch.no_grad():
        for name, tensor in saved.items():
            if name in own:
                own[name].copy_(tensor)


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


def _replace_dir(src: Path, dst: Path) -> None:
    """Move the finished `src` to `dst`, replacing an older checkpoint only after the move."""
    old = None
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
