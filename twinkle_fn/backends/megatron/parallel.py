"""megatron-core's process groups and RNG seeds from a `Mesh`.

`initialize` lays megatron-core's groups over the existing default process group in the mesh's
rank order (``tp-cp-ep-dp-pp``; megatron's data parallelism is our ``dp * fsdp``), so every
group megatron builds is the one `Mesh.group_ranks` names. On a machine without CUDA it enables
`twinkle_fn.backends.megatron.cpu_compat` first; `destroy` undoes both.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from twinkle_fn.backends.megatron import cpu_compat
from twinkle_fn.mesh import Mesh


def _check_vpp(vpp: int | None) -> None:
    if vpp is None:
        return
    if isinstance(vpp, bool) or not isinstance(vpp, int) or vpp < 1:
        raise ValueError(f"vpp must be None or a positive int, got {vpp!r}; use vpp=None")
    if vpp > 1:
        raise ValueError(
            f"virtual pipeline parallelism is not supported yet (vpp={vpp}); use vpp=None"
        )


def initialize(mesh: Mesh, seed: int = 0, *, vpp: int | None = None) -> None:
    """Initialize megatron-core's model-parallel state for `mesh` and seed every RNG.

    Needs ``torch.distributed`` initialized with ``mesh.world_size`` ranks. Seeds the CPU RNG
    with `seed` on every rank (megatron-core's CPU initialisation draws master weights from it,
    so they agree across ranks) and megatron's tracked RNG states (data-, tensor- and
    expert-parallel streams). With CUDA, selects the device ``LOCAL_RANK``; without, enables
    `cpu_compat`.

    Raises ``ValueError`` for ``vpp > 1`` (virtual pipeline parallelism is not supported yet),
    ``ulysses > 1`` (the transformers backend's) or a mesh whose size differs from the world's,
    and ``RuntimeError`` if torch.distributed is not initialized or megatron-core's state
    already is (call `destroy` first).
    """
    _check_vpp(vpp)
    if mesh.ulysses > 1:
        raise ValueError(
            f"mesh ulysses={mesh.ulysses}: Ulysses sequence parallelism belongs to the "
            "transformers backend; use cp (context parallelism) on the megatron backend"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized; call torch.distributed.init_process_group "
            "(or launch with torchrun) before twinkle_fn.backends.megatron.parallel.initialize"
        )
    mesh.validate(dist.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "megatron-core's model-parallel state is already initialized; call "
            "twinkle_fn.backends.megatron.parallel.destroy() before initializing it again"
        )
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        torch.cuda.set_device(local)
    else:
        cpu_compat.enable()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=mesh.tp,
        pipeline_model_parallel_size=mesh.pp,
        context_parallel_size=mesh.cp,
        expert_model_parallel_size=mesh.ep,
        expert_tensor_parallel_size=mesh.etp,
        order="tp-cp-ep-dp-pp",
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    """Tear down megatron-core's model-parallel state and disable `cpu_compat` if enabled.

    The default process group stays initialized. A no-op when nothing is initialized.
    """
    parallel_state.destroy_model_parallel()
    cpu_compat.disable()
