"""Save and load a `TrainState` as a directory that transformers can also load.

Every backend writes the HF model files (``config.json``, ``*.safetensors``; the tokenizer when
given), so ``AutoModelForCausalLM.from_pretrained(dir)`` works, plus its own training state: the
transformers backend ``twinkle_state.pt`` and, sharded, ``dcp/`` (torch.distributed.checkpoint);
the megatron backend ``megatron/`` (megatron-core's ``dist_checkpointing``). Both load on another
mesh. This module owns what does not depend on the backend: ``twinkle_manifest.json`` (format,
step, backend, ``extra``) and the atomic directory switch.

A save writes into a temporary sibling directory (`staged`) and switches it into place in one
atomic step once everything is written: ``renameat2(RENAME_EXCHANGE)`` swaps the new directory
with the old one, so `path` is at every instant either the old checkpoint or the new one, and
``from_pretrained(path)`` keeps working on it. Where the file system lacks the exchange (not
Linux, some network file systems) the old directory is parked under a hidden sibling name first;
a process killed between the two renames leaves `path` missing, and `current` (which every reader
here goes through) finds the parked checkpoint, which the next save moves back. Leftovers of
interrupted saves are removed by the next save to the same path.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from twinkle_fn import backends
from twinkle_fn.distributed import rank, world_size
from twinkle_fn.state import TrainState
from twinkle_fn.tensor_specs import TensorSpec, check_specs, safetensors_specs

MANIFEST = "twinkle_manifest.json"
FORMAT = 1


def save(
    state: TrainState,
    path: str | os.PathLike[str],
    *,
    tokenizer: Any = None,
    extra: dict[str, Any] | None = None,
    allow_nonfinite: bool = False,
) -> Path:
    """Write `state` (and `tokenizer`, and JSON-able `extra`) to the directory `path`.

    On several ranks every rank must call it (it gathers the HF weights and writes its own
    shards); rank 0 writes the rest. An existing checkpoint at `path` is replaced, in one atomic
    step, only after the new one is complete. Returns the path. Raises ``DonatedError`` for a
    donated state, ``TypeError`` for non-JSON `extra`, ``ValueError`` (before writing anything)
    for a parameter holding NaN or infinity unless `allow_nonfinite` (a diverged run must not
    replace a good checkpoint), and what the backend refuses to save (the megatron backend: a
    state of another optimizer than its own, or of LoRA adapters).
    """
    state.check_alive()
    json.dumps(extra or {})
    if not allow_nonfinite:
        check_finite(state)
    with staged(path) as directory:
        save_into(state, directory, tokenizer=tokenizer, extra=extra)
    return Path(path)


def check_finite(state: TrainState) -> None:
    """Raise ``ValueError`` naming the parameters of `state` that hold NaN or infinity (on any
    rank: a collective on several ranks, every rank must call it)."""
    state.check_alive()
    bad = [n for n, p in state.params.items() if not bool(torch.isfinite(_local(p)).all())]
    count = torch.tensor([len(bad)], dtype=torch.int64)
    if world_size() > 1:  # every rank must agree whether to save
        dist.all_reduce(count)
    if int(count):
        raise ValueError(
            f"refusing to save a train state at step {int(state.step)} whose parameters hold "
            f"NaN or infinity ({int(count)} parameter shards, here: {bad[:3]}); the run has "
            "diverged: resume from the last good checkpoint with a lower learning rate, or "
            "pass allow_nonfinite=True to save it anyway"
        )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (a DTensor's local shard, else the tensor itself)."""
    to_local = getattr(tensor, "to_local", None)
    return (to_local() if to_local is not None else tensor).detach()


def save_into(
    state: TrainState,
    directory: str | os.PathLike[str],
    *,
    tokenizer: Any = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write the checkpoint of `state` into `directory` (created if missing) with no switch:
    for a save made of several parts inside one `staged` block. `save` is `staged` around this.

    Every rank must call it; the manifest is written last. Raises as `save`.
    """
    state.check_alive()
    directory = Path(directory)
    extra = extra or {}
    json.dumps(extra)
    backend = backends.get(state.model.backend)
    writer = rank() == 0
    if writer:
        directory.mkdir(parents=True, exist_ok=True)
    _barrier()
    layout = backend.save(state, directory)
    if writer:
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
        manifest = {"format": FORMAT, "step": int(state.step), "extra": extra}
        manifest.update(layout, backend=state.model.backend)
        _write_json(directory / MANIFEST, manifest)
    _barrier()
    return directory


@contextlib.contextmanager
def staged(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A fresh temporary sibling directory of `path` to write a new version into; when the block
    ends without an exception it replaces `path` in one atomic step (`replace_dir`), and on an
    exception it is removed and `path` is left as it was.

    Every rank must enter it (rank 0 creates, switches and cleans; the others wait at
    barriers). On entry, leftovers of earlier interrupted saves to `path` are removed (a
    checkpoint parked by an interrupted switch is first moved back to `path`).
    """
    path = Path(path)
    writer = rank() == 0
    tmp = path.parent / f".{path.name}{_TMP}{_shared_token()}"
    try:
        if writer:
            _clean_leftovers(path)
            tmp.mkdir(parents=True)
        _barrier()
        yield tmp
        if writer:
            replace_dir(tmp, path)
        _barrier()
    except BaseException:
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def current(path: str | os.PathLike[str]) -> Path:
    """The directory holding the last complete save to `path`: `path` itself, or, when a switch
    without atomic exchange was interrupted between its two renames, the old version it parked."""
    path = Path(path)
    if path.exists():
        return path
    parked = _siblings(path, _OLD)
    return max(parked, key=lambda p: p.stat().st_mtime_ns) if parked else path


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether `path` holds a checkpoint whose save finished."""
    return (current(path) / MANIFEST).is_file()


def read_extra(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``extra`` dict saved with the checkpoint at `path`."""
    return _manifest(current(path))["extra"]


def load(state: TrainState, path: str | os.PathLike[str], *, donate: bool = True) -> TrainState:
    """`state` with parameters, optimizer state, step and RNG key read from `path`.

    `state` provides the structure (module, optimizer transform, mesh), which may differ from
    the mesh the checkpoint was saved on. With ``donate=True`` its buffers are overwritten in
    place and it is consumed; ``donate=False`` (an unplaced state on one process only) fills a
    copy. On several ranks every rank must call it. Everything the load reads is checked
    first (names, shapes, dtypes, finiteness, truncated files): a refused load writes nothing
    and leaves `state` usable and bit-identical. Raises ``ValueError`` naming the tensor, the
    expected and found shape or dtype, and the file, for an incomplete or incompatible
    checkpoint (missing manifest, another backend's state, another model's tensors, other
    trainable parameters, another optimizer's state, NaN or infinity).
    """
    state.check_alive()
    path = current(path)
    manifest = _manifest(path)
    _check_backend(state, manifest, path)
    if not donate and state.model.placement is not None:
        raise ValueError(
            "load(donate=False) copies the state, which a sharded or megatron model cannot do"
        )
    _check_family(state, path)
    backend = backends.get(state.model.backend)
    specs, aliases = backend.hf_specs(state)
    where = f"checkpoint {path}"
    check_specs(safetensors_specs(path), specs, where=where, optional=aliases)
    target = state.replace() if donate else state.copy()
    new = backend.load(target, path, manifest)
    if donate:  # only now: a refused load leaves `state` usable
        state.donate("checkpoint.load")
    return new


def load_weights(
    state: TrainState,
    path: str | os.PathLike[str],
    rename: Callable[[str], str] | None = None,
) -> None:
    """Copy the HF weights (``*.safetensors``) of the directory `path` into `state`'s trainable
    parameters, in place: any HF checkpoint of the same model (any floating dtype: a bfloat16
    release loads into float32 weights), or an adapter file with `rename` mapping its keys to
    parameter names. Optimizer state and step are left as they are. On several ranks every
    rank must call it. Every tensor's name, shape and finiteness is checked before the first
    parameter is written. Raises `DonatedError` for a donated state, ``ValueError`` naming the
    tensor and file for a directory without weights, a truncated file, a tensor missing, extra
    (another model or family), of another shape or non-floating dtype, or holding NaN or
    infinity.
    """
    state.check_alive()
    path = current(path)
    backend = backends.get(state.model.backend)
    _check_family(state, path)
    if rename is None:
        specs, aliases = backend.hf_specs(state)
    else:
        specs, aliases = {n: TensorSpec.of(p) for n, p in state.params.items()}, frozenset()
    check_specs(
        safetensors_specs(path, rename), specs, where=str(path), optional=aliases, cast=True
    )
    backend.load_weights(state, path, rename)


def read_weights(
    path: str | os.PathLike[str], rename: Callable[[str], str] | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in the directory `path` (CPU), keyed by
    `rename` of its file key. Raises ``ValueError`` when `path` holds no safetensors file."""
    files = sorted(current(path).glob("*.safetensors"))
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


def _check_family(state: TrainState, path: Path) -> None:
    """Refuse the HF weights at `path` when its ``config.json`` names another model family
    than `state`'s (two families may share every tensor name and shape, e.g. llama and
    mistral, and compute something else with them)."""
    config = path / "config.json"
    if not config.is_file():
        return
    saved = json.loads(config.read_text()).get("model_type")
    if saved is not None and saved != state.model.config.model_type:
        raise ValueError(
            f"{path} holds a {saved!r} model (config.json), this state a "
            f"{state.model.config.model_type!r} one; load weights of the same family, or build "
            f"the model from them: tf.models.from_pretrained({str(path)!r})"
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
    """Move the finished directory `src` to `dst` in one atomic step: `dst` is at every instant
    the old directory or the new one (see the module docstring for file systems without an
    atomic exchange). The old directory is removed afterwards."""
    if not dst.exists():
        os.rename(src, dst)
    elif _exchange(src, dst):
        shutil.rmtree(src, ignore_errors=True)
    else:
        old = dst.parent / f".{dst.name}{_OLD}{uuid.uuid4().hex[:8]}"
        os.rename(dst, old)
        os.rename(src, dst)
        shutil.rmtree(old, ignore_errors=True)


# Hidden siblings of a checkpoint `name`: `.name.tmp-<token>` a version being written,
# `.name.old-<token>` the previous version parked by a non-atomic switch.
_TMP = ".tmp-"
_OLD = ".old-"
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
_LIBC = ctypes.CDLL(None, use_errno=True) if os.name == "posix" else None


def _exchange(a: Path, b: Path) -> bool:
    """Swap the directories `a` and `b` atomically (Linux ``renameat2``); False where the
    system or file system offers no atomic exchange."""
    renameat2 = getattr(_LIBC, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _siblings(path: Path, kind: str) -> list[Path]:
    if not path.parent.is_dir():
        return []
    return [p for p in path.parent.glob(f".{path.name}{kind}*") if p.is_dir()]


def _clean_leftovers(path: Path) -> None:
    """Undo what interrupted saves to `path` left: move a parked checkpoint back to `path` when
    `path` is missing, then remove temporary and parked directories."""
    found = current(path)
    if found != path:
        os.rename(found, path)
    for leftover in _siblings(path, _TMP) + _siblings(path, _OLD):
        shutil.rmtree(leftover, ignore_errors=True)
