"""A transformers model's whole parameters cut into one rank's pieces, and joined back, as data.

`shard_params` gives what `fsdp.parallelize` leaves on a rank (``DTensor.to_local()`` of each
parameter): every tensor under its `plans.param_specs`, the family's TP plan (`plans.tp_plan`,
the plan ``parallelize`` applies) then FSDP2's dim-0 split of the tp-local tensor over
`plans.data_axis`. `unshard_params` joins every rank's pieces into the whole tensors again. Both
are pure (no communication: any rank's pieces can be computed on one process).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import PretrainedConfig

from twinkle_fn.backends.transformers.expert_parallel import check_expert_parallel
from twinkle_fn.backends.transformers.plans import local_specs, param_specs
from twinkle_fn.mesh import Mesh
from twinkle_fn.sharding import unshard_pieces


def check_mesh(mesh: Mesh) -> None:
    """Refuse a mesh this backend does not place on. Raises ``ValueError`` for pp or cp > 1
    (the megatron backend's axes); ep is checked against the model
    (`twinkle_fn.backends.transformers.expert_parallel.check_expert_parallel`)."""
    if mesh.pp > 1 or mesh.cp > 1:
        raise ValueError(
            f"the fsdp backend parallelises over dp, fsdp, tp and (for MoE experts) ep; {mesh} "
            "asks for pp/cp, which the megatron backend provides"
        )


def shard_params(
    full: Mapping[str, torch.Tensor], mesh: Mesh, config: PretrainedConfig, rank: int
) -> dict[str, torch.Tensor]:
    """The pieces of the whole tensors `full` that `rank` of `mesh` holds, by the same names.

    `full` maps parameter names as the module names them (``named_parameters`` /
    ``state_dict``, peft LoRA layers included) to whole tensors of any shape with a dim 0. The
    pieces are views of `full`'s tensors (empty where an uneven split leaves the rank nothing).
    Raises ``ValueError`` for a mesh the backend does not place on (see `check_mesh`), a `rank`
    outside the mesh, a tp that does not divide the model (`plans.tp_plan`), an ep the model
    cannot split (`expert_parallel.check_expert_parallel`), or a 0-d tensor.
    """
    check_mesh(mesh)
    check_expert_parallel(config, mesh)
    coords = {**mesh.coords(rank), **mesh.expert_coords(rank)}
    specs = param_specs(full, config, mesh)
    return {n: local_specs(t, specs[n], coords, mesh) for n, t in full.items()}


def unshard_params(
    pieces_by_rank: Mapping[int, Mapping[str, torch.Tensor]], mesh: Mesh, config: PretrainedConfig
) -> dict[str, torch.Tensor]:
    """The whole tensors whose pieces on each rank are ``pieces_by_rank[rank]``: the inverse of
    `shard_params` over every rank of `mesh`.

    Results are concatenations of the pieces, or a piece itself where every rank holds the
    whole tensor. Raises ``ValueError`` for a mesh the backend does not place on, no pieces,
    ranks holding different names, a rank of the mesh missing, and pieces that do not join or
    replicas that differ (`twinkle_fn.sharding.unshard_pieces`).
    """
    check_mesh(mesh)
    check_expert_parallel(config, mesh)
    if not pieces_by_rank:
        raise ValueError("unshard_params got no pieces; pass every rank's pieces by rank")
    ranks = sorted(pieces_by_rank)
    names = list(pieces_by_rank[ranks[0]])
    for r in ranks[1:]:
        if set(pieces_by_rank[r]) != set(names):
            diff = sorted(set(pieces_by_rank[r]) ^ set(names))
            raise ValueError(
                f"rank {r} holds other names than rank {ranks[0]} (differing: {diff[:5]}); "
                "every rank holds a piece of every parameter"
            )
    specs = param_specs(names, config, mesh)
    return {
        n: unshard_pieces({r: pieces_by_rank[r][n] for r in ranks}, specs[n], mesh) for n in names
    }
