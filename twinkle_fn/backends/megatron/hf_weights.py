"""Copying this rank's slices of a model's HF weights into its megatron-core stage.

`load_hf_weights` reads them from the model's checkpoint files (memory-mapped, only this rank's
rows) or from its module, through the bridge (`twinkle_fn.backends.megatron.sharding`), checks
that they fit the stage and hold no NaN or infinity, and copies them in: as the stage is built
(`twinkle_fn.backends.megatron.placement.place`), or into a live state's stage
(`twinkle_fn.backends.megatron.dist_checkpoint.load_weights`), where a refused load leaves the
stage as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from twinkle_fn.backends.megatron.safetensors_io import SafetensorsReader
from twinkle_fn.backends.megatron.sharding import checkpoint_names, iter_local_weights
from twinkle_fn.mesh import Mesh
from twinkle_fn.models.model import Model
from twinkle_fn.tensor_specs import check_finite


def load_hf_weights(
    gpt: torch.nn.Module, model: Model, mesh: Mesh, vocab_multiple: int, *, fresh: bool = False
) -> None:
    """Copy this rank's slices of the model's HF weights into `gpt` (read from the files when
    the model has a ``weights_dir``, else from its module, in HF checkpoint names), cut by
    `sharding.local_weights`: what ``tf.shard(params, mesh, model)`` computes. On a `fresh` `gpt`
    (the model's first load), tensors the files lack are read from the module where it
    holds them: a critic loaded from a causal LM's checkpoint has its body in the files and
    its freshly initialised value head in the module (`twinkle_fn.models.from_pretrained`).

    Slices stream one at a time: each is read from the memory-mapped file straight onto
    `gpt`'s device and converted there (q/k/v and gate/up fused, the vocabulary padded), and
    their finiteness is checked with one host sync at the end (agreed over the ranks). A
    `fresh` `gpt` (being built: nothing else can see it) takes each slice as it arrives, so no
    second copy of the model is held and a refused load leaves nothing behind; otherwise (a
    live state's model) every slice is read and checked before the first is written, so a
    refused load leaves `gpt` as it was. Raises ``RuntimeError`` when the slices do not fit
    `gpt` (naming the missing, unexpected and misshapen ones) and ``ValueError`` naming the
    tensor holding NaN or infinity.
    """
    rank = dist.get_rank()
    own = {k: v for k, v in gpt.state_dict().items() if not k.endswith("._extra_state")}
    device = next(iter(own.values())).device
    slices: dict[str, Tensor] = {}  # what was read: the parameters themselves when fresh
    unexpected: list[str] = []
    misshapen: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    with contextlib.ExitStack() as stack:
        if model.weights_dir is not None:
            source = f"the HF checkpoint {model.weights_dir}"
            hf: Any = stack.enter_context(SafetensorsReader(model.weights_dir, device))
            held = {n: t for n, t in model.module.state_dict().items() if not t.is_meta}
            if fresh and held:
                hf = _Overlay(hf, held)
        else:
            source = "the model's module"
            hf = checkpoint_names(model, model.module.state_dict())
        weights = iter_local_weights(hf, model.config, mesh, rank, vocab_multiple, model.head)
        with torch.no_grad():
            for name, tensor in weights:
                dst = own.get(name)
                if dst is None:
                    unexpected.append(name)
                elif dst.shape != tensor.shape:
                    misshapen.append((name, tuple(tensor.shape), tuple(dst.shape)))
                elif fresh:
                    slices[name] = dst.copy_(tensor)
                else:
                    slices[name] = tensor
    missing = sorted(set(own) - set(slices) - {n for n, _, _ in misshapen})
    if missing or unexpected or misshapen:
        raise RuntimeError(
            f"the HF weights of {source} do not fit the megatron model: missing {missing[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}, other shapes {misshapen[:3]}"
        )
    check_finite(slices, where=f"{source} (megatron slices)", device=device)
    if not fresh:
        with torch.no_grad():
            for name, tensor in slices.items():
                own[name].copy_(tensor)


class _Overlay:
    """A `twinkle_fn.backends.megatron.bridge.SliceSource`: `files`' tensors, and where they
    lack one, `held`'s (whole tensors by HF name)."""

    def __init__(self, files: SafetensorsReader, held: Mapping[str, Tensor]) -> None:
        self._files, self._held = files, held

    def _from_files(self, name: str) -> bool:
        try:
            self._files.shape(name)
        except KeyError:
            return name not in self._held
        return True

    def shape(self, name: str) -> tuple[int, ...]:
        return self._files.shape(name) if self._from_files(name) else tuple(self._held[name].shape)

    def get(self, name: str) -> Tensor:
        return self._files.get(name) if self._from_files(name) else self._held[name].detach()

    def get_rows(self, name: str, dim: int, start: int, stop: int) -> Tensor:
        if self._from_files(name):
            return self._files.get_rows(name, dim, start, stop)
        return self._held[name].detach().narrow(dim, start, stop - start)
