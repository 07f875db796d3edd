"""A megatron model's whole HF tensors cut into one rank's megatron tensors, and joined back.

`local_weights` is what `placement` loads into a rank's ``GPTModel`` stage: the bridge rules
(`bridge.hf_to_mcore`) at the rank's tp / pp / ep / etp coordinates of the mesh.
`shard_params` applies it to a bare mapping and `unshard_params` joins every rank's tensors into
whole HF tensors (`bridge.mcore_to_hf`). All are pure (no communication: any rank's tensors can
be computed on one process).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.core_model_loading import revert_weight_conversion

from twinkle_fn.backends.megatron.bridge import HFState, iter_hf_to_mcore, mcore_to_hf
from twinkle_fn.mesh import Mesh
from twinkle_fn.models.model import Model

VOCAB_MULTIPLE = 128  # Megatron-LM's make_vocab_size_divisible_by


def vocab_multiple(options: Mapping[str, Any]) -> int:
    """The model option ``vocab_multiple``: the vocabulary is zero-padded to a multiple of it
    times tp (default `VOCAB_MULTIPLE`). Raises ``ValueError`` unless it is a positive int."""
    value = options.get("vocab_multiple", VOCAB_MULTIPLE)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"option vocab_multiple must be a positive int, got {value!r}")
    return value


def local_weights(
    source: HFState,
    config: PretrainedConfig,
    mesh: Mesh,
    rank: int,
    multiple: int,
    head: str = "lm",
) -> dict[str, torch.Tensor]:
    """`rank`'s megatron tensors of the HF tensors in `source`, by megatron name.

    `source` is as `bridge.hf_to_mcore` reads it (a mapping, a getter, a `SafetensorsReader`)
    in HF checkpoint names; `multiple` is the vocabulary padding unit (`vocab_multiple`);
    `head` the model's (`twinkle_fn.models.model.HEADS`). Raises ``ValueError`` for a `rank` outside `mesh` and as ``hf_to_mcore`` does.
    """
    return dict(iter_local_weights(source, config, mesh, rank, multiple, head))


def iter_local_weights(
    source: HFState,
    config: PretrainedConfig,
    mesh: Mesh,
    rank: int,
    multiple: int,
    head: str = "lm",
) -> Iterator[tuple[str, torch.Tensor]]:
    """`local_weights` one ``(megatron name, tensor)`` at a time, each read when asked for
    (`bridge.iter_hf_to_mcore`). Raises as `local_weights` does (a missing or misshapen HF
    tensor when it is reached)."""
    coords, expert = mesh.coords(rank), mesh.expert_coords(rank)
    return iter_hf_to_mcore(
        source,
        config,
        tp_rank=coords["tp"],
        tp_size=mesh.tp,
        pp_rank=coords["pp"],
        pp_size=mesh.pp,
        ep_rank=expert["ep"],
        ep_size=mesh.ep,
        etp_rank=expert["etp"],
        etp_size=mesh.etp,
        vocab_multiple=multiple,
        head=head,
    )


def checkpoint_names(model: Model, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`full` in HF checkpoint names: a transformers module's in-memory fusions (Qwen3-MoE's
    ``mlp.experts.gate_up_proj``) become one tensor per expert; names already in checkpoint
    form pass through."""
    return revert_weight_conversion(model.module, dict(full))


def shard_params(
    full: Mapping[str, torch.Tensor], mesh: Mesh, model: Model, rank: int
) -> dict[str, torch.Tensor]:
    """The megatron tensors `rank` of `mesh` holds, cut from the whole HF tensors `full`.

    `full` is in HF names, as the module's ``state_dict`` or a checkpoint holds them (see
    `checkpoint_names`); names the bridge does not read (a tied ``lm_head.weight``) are left
    out. Keys are megatron names, as a state's ``params`` (a model training LoRA adapters
    trains adapters instead); the vocabulary rows are padded with zeros to the model's
    `vocab_multiple`. Tensors may share memory with `full`. Raises ``ValueError`` for a bad
    option, a `rank` outside the mesh, a mesh that does not split the model, or a missing or
    misshapen tensor (`bridge.hf_to_mcore`).
    """
    multiple = vocab_multiple(model.options)
    named = checkpoint_names(model, full)
    return local_weights(named, model.config, mesh, rank, multiple, model.head)


def unshard_params(
    pieces_by_rank: Mapping[int, Mapping[str, torch.Tensor]], mesh: Mesh, model: Model
) -> dict[str, torch.Tensor]:
    """The whole HF tensors, in checkpoint names, whose megatron tensors on each rank are
    ``pieces_by_rank[rank]``: the inverse of `shard_params` over every rank of `mesh`.

    Tensors held by several ranks (replicas over data, context and expert ranks) are read from
    the lowest of them; a tied embedding's output copy is not returned; the vocabulary padding
    is dropped. Raises ``ValueError`` for a rank of the mesh missing or unknown, a bad option, a
    mesh that does not split the model, and a tensor missing from a rank
    (`bridge.mcore_to_hf`).
    """
    world = set(range(mesh.world_size))
    if set(pieces_by_rank) != world:
        raise ValueError(
            f"pieces_by_rank must hold exactly the ranks 0..{mesh.world_size - 1} of {mesh}; "
            f"missing {sorted(world - set(pieces_by_rank))}, "
            f"unknown {sorted(set(pieces_by_rank) - world)}"
        )
    states: dict[tuple[int, ...], Mapping[str, torch.Tensor]] = {}
    for r in sorted(pieces_by_rank):
        coords, expert = mesh.coords(r), mesh.expert_coords(r)
        key = (coords["tp"], coords["pp"], expert["ep"], expert["etp"])
        states.setdefault(key, pieces_by_rank[r])
    return dict(
        mcore_to_hf(
            states,
            model.config,
            tp_size=mesh.tp,
            pp_size=mesh.pp,
            ep_size=mesh.ep,
            etp_size=mesh.etp,
            vocab_multiple=vocab_multiple(model.options),
            head=model.head,
        )
    )
