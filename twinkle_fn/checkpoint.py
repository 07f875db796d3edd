"""Save and load a `TrainState` as a directory that transformers can also load.

Every backend writes the HF model files (``config.json``, ``*.safetensors``; the tokenizer when
given), so ``AutoModelForCausalLM.from_pretrained(dir)`` works, plus its own training state: the
transformers backend ``twinkle_state.pt`` and, sharded, ``dcp/`` (torch.distributed.checkpoint);
the megatron backend ``megatron/`` (megatron-core's ``dist_checkpointing``). Both load on another
mesh. This module owns what does not depend on the backend: ``twinkle_manifest.json`` (format,
step, backend, ``extra``) and the atomic directory switch.

A save writes into a temporary sibling directory and renames it into place only once the
manifest is written, so an interrupted save never leaves a directory that `load` accepts.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from twinkle_fn import backends
from twinkle_fn.distributed import rank, world_size
from twinkle_fn.state import TrainState

MANIFEST = "twinkle_manifest.json"
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
    ``TypeError`` for non-JSON `extra`, and what the backend refuses to save (the megatron
    backend: a state of another optimizer than its own, or of LoRA adapters).
    """
    state.check_alive()
    path = Path(path)
    extra = extra or {}
    json.dumps(extra)
    backend = backends.get(state.model.backend)
    writer = rank() == 0
    tmp = path.parent / f".{path.name}.tmp-{_shared_token()}"
    try:
        if writer:
            tmp.mkdir(parents=True)
        _barrier()
        layout = backend.save(state, tmp)
        if writer:
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            manifest = {"format": FORMAT, "step": int(state.step), "extra": extra}
            manifest.update(layout, backend=state.model.backend)
            _write_json(tmp / MANIFEST, manifest)
            replace_dir(tmp, path)
        _barrier()
    except BaseException:
        if writer:
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

    `state` provides the structure (module, optimizer transform, mesh), which may differ from
    the mesh the checkpoint was saved on. With ``donate=True`` its buffers are overwritten in
    place and it is consumed; ``donate=False`` (an unplaced state on one process only) fills a
    copy. On several ranks every rank must call it. Raises ``ValueError`` for an incomplete or
    incompatible checkpoint (missing manifest, another backend's state, other trainable
    parameters, another optimizer's state).
    """
    path = Path(path)
    manifest = _manifest(path)
    _check_backend(state, manifest, path)
    if donate:
        new = state.replace()
        state.donate("checkpoint.load")
    elif state.model.placement is not None:
        raise ValueError(
            "load(donate=False) copies the state, which a sharded or megatron model cannot do"
        )
    else:
        new = state.copy()
    return backends.get(new.model.backend).load(new, path, manifest)


def load_weights(
    state: TrainState,
    path: str | os.PathLike[str],
    rename: Callable[[str], str] | None = None,
) -> None:
    """Copy the HF weights (``*.safetensors``) of the directory `path` into `state`'s trainable
    parameters, in place: any HF checkpoint of the same model, or an adapter file with `rename`
    mapping its keys to parameter names. Optimizer state and step are left as they are. On
    several ranks every rank must call it. Raises `DonatedError` for a donated state,
    ``ValueError`` for a directory without weights or lacking one of the state's parameters,
    and for a tensor of another shape.
    """
    state.check_alive()
    backends.get(state.model.backend).load_weights(state, Path(path), rename)


def read_weights(
    path: str | os.PathLike[str], rename: Callable[[str], str] | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in the directory `path` (CPU), keyed by
    `rename` of its file key. Raises ``ValueError`` when `path` holds no safetensors file."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} holds no .safetensors weights")
    rename = rename or (lambda key: key)
    saved: dict[str, torch.Tensor] = {}
    for f in files:
        saved.update({rename(k): v for k, v in load_file(f).items()})
    return saved


def _check_backend(state: TrainState, manifest: dict[str, Any], path: Path) -> None:
    # checkpoints before megatron's have no backend; older ones name the transformers one "fsdp"
    saved = backends.canonical(manifest.get("backend", "transformers"))
    if saved != state.model.backend:
        raise ValueError(
            f"checkpoint {path} holds a {saved!r} train state, which a {state.model.backend!r} "
            f"state cannot load; start from its HF weights instead: "
            f"tf.models.from_pretrained({str(path)!r}, backend={state.model.backend!r})"
        )


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
