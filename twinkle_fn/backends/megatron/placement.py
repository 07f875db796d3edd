"""Where a model lives on the megatron backend, and how it gets there.

`place` builds this rank's ``GPTModel`` pipeline stage from the model's HF config over
megatron-core's process groups (`twinkle_fn.backends.megatron.parallel`), loads this rank's
slices of the HF weights through the bridge (`twinkle_fn.backends.megatron.hf_weights`), and
wraps the stage in ``Float16Module`` (bf16 / fp16) and megatron's ``DistributedDataParallel``
(fp32 grad buffers, the distributed optimizer's layout, reductions overlapped with backward
unless ``overlap_grad_reduce=False``, see `twinkle_fn.backends.megatron.grad_sync`). It reads
the ``Model.options`` that `twinkle_fn.backends.megatron.placement_options` checks and
`twinkle_fn.backends.megatron.backend` describes.
"""

from __future__ import annotations

import dataclasses
import weakref
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.transformer.module import Float16Module
from torch import Tensor

from twinkle_fn.backends.megatron import grad_sync, parallel, param_sync
from twinkle_fn.backends.megatron.bridge_rules import value_bias
from twinkle_fn.backends.megatron.fp8_linears import store_frozen, use_fp8_linears
from twinkle_fn.backends.megatron.hf_weights import load_hf_weights
from twinkle_fn.backends.megatron.layer_compile import compile_decoder_layers
from twinkle_fn.backends.megatron.lora import LoraPlan, add_adapters
from twinkle_fn.backends.megatron.model import build_gpt_model
from twinkle_fn.backends.megatron.placement_options import (
    ROUTER_LOSS_FIELDS,
    Options,
    read_options,
)
from twinkle_fn.mesh import Mesh
from twinkle_fn.models.families import family
from twinkle_fn.models.model import Model

PLACEMENT_ATTR = "twinkle_placement"  # a weakref set on every parameter by `prepare`
# Every parameter is overwritten by the HF weights (`load_hf_weights` refuses a missing one), so
# the stage is built uninitialised, in the compute dtype (what ``Float16Module`` casts it to
# anyway), directly on the GPU when there is one: megatron's default float32 CPU initialisation
# of a 4B model draws 16 GB of random numbers on the host and copies them over, most of the
# 47 s its load took.
_EMPTY_BUILD = MappingProxyType(
    dict(perform_initialization=False, use_cpu_initialization=not torch.cuda.is_available())
)
# What the models' ``activation_checkpointing=True`` means in megatron's terms.
_FULL_RECOMPUTE = MappingProxyType(
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
)


@dataclasses.dataclass(eq=False)
class MegatronPlacement:
    """Where a model lives on the megatron backend (``Model.placement``).

    ``chunks``: this rank's model chunks wrapped in megatron's DDP (one: virtual pipelining is
    refused); ``module``: the unwrapped ``GPTModel`` stage, whose parameter names the state
    uses; ``live_grads``: the parameter tree of the `Grads` that owns the DDP grad buffers now
    (None when none does), so that stale gradients are refused instead of silently read;
    ``lora``: which linears carry LoRA adapters when the model trains adapters only
    (``Model.options["lora"]``, see `twinkle_fn.backends.megatron.lora`), else None;
    ``overlap_grad_reduce``: whether the DDP reduces gradients bucket by bucket during backward
    (`twinkle_fn.backends.megatron.grad_sync`) rather than all at once in ``step``;
    ``overlap_param_gather``: whether ``step`` leaves the distributed optimizer's parameter
    all-gathers in flight, for the next forward to wait on (`twinkle_fn.backends.megatron.param_sync`);
    ``head``: the model's (`twinkle_fn.models.model.HEADS`; ``"value"``: a critic, whose last
    stage ends in `twinkle_fn.backends.megatron.model.ValueHead`).
    """

    mesh: Mesh
    chunks: list[DistributedDataParallel]
    module: torch.nn.Module
    hf_config: Any
    compute_dtype: torch.dtype
    num_micro_batches: int
    vocab_multiple: int
    live_grads: dict[str, Tensor] | None = None
    lora: LoraPlan | None = None
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    head: str = "lm"

    @property
    def seq_multiple(self) -> int:
        """What each rank's part of a micro-batch's sequence must divide by (sequence
        parallelism); `twinkle_fn.backends.megatron.micro_batch.micro_batches` adds context parallelism's."""
        return self.mesh.tp if self.mesh.sequence_parallel else 1


def place(model: Model, mesh: Mesh) -> MegatronPlacement:
    """Build, load and wrap this rank's ``GPTModel`` stage of `model` for `mesh`.

    Starts a one-rank process group when there is none and `mesh` has one rank, and
    megatron-core's parallel state (seed 0) unless it is already initialised for `mesh`; sets
    a weak reference to the placement on every parameter as attribute `PLACEMENT_ATTR`. A
    critic (``model.head == "value"``) ends in a value head. Raises ``ValueError`` for
    unknown options, LoRA on a critic, a megatron-core already initialised for another mesh, or
    as ``build_gpt_model`` does; ``RuntimeError`` without a process group on a multi-rank mesh or
    when the weights do not fit the model.
    """
    opts = read_options(model.options, mesh)
    if model.options.get("lora") is not None and model.head == "value":
        raise ValueError(
            "LoRA on a value model would freeze its freshly initialised value head (only "
            "adapters train); train the critic's full weights (drop the LoRA config)"
        )
    overrides = opts.overrides
    if family(model.config).moe is not None:
        overrides = {**overrides, **ROUTER_LOSS_FIELDS}
    if getattr(model.module, "is_gradient_checkpointing", False):
        overrides = {**_FULL_RECOMPUTE, **overrides}
    _ensure_process_group(mesh)
    _ensure_parallel_state(mesh)
    dtype = model.compute_dtype
    gpt = build_gpt_model(
        model.config,
        mesh,
        use_te=opts.use_te,
        grouped_experts=opts.grouped_experts,
        vocab_multiple=opts.vocab_multiple,
        head=model.head,
        value_bias=value_bias(model.config),
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        **{**_EMPTY_BUILD, "params_dtype": dtype, **overrides},
    )
    load_hf_weights(gpt, model, mesh, opts.vocab_multiple, fresh=True)
    lora = model.options.get("lora")
    # Before DDP and the optimizer: their buffers and state then cover the adapters only.
    plan = None if lora is None else add_adapters(gpt, lora, model.module)
    use_fp8_linears(gpt, model.options.get("fp8"))
    compile_decoder_layers(gpt.decoder.layers, model.options.get("compile_layers", False))
    wrapped = gpt if dtype == torch.float32 else Float16Module(gpt.config, gpt)
    store_frozen(gpt, model.options)
    chunk = _ddp(gpt, wrapped, opts)
    if opts.overlap_param_gather:
        param_sync.enable(chunk)
    if opts.overlap_grad_reduce:
        grad_sync.check_overlappable(chunk)
        # megatron's schedule reduces on the last micro-batch of a call only.
        gpt.config.no_sync_func = chunk.no_sync
    placement = MegatronPlacement(
        mesh=mesh,
        chunks=[chunk],
        module=gpt,
        hf_config=model.config,
        compute_dtype=dtype,
        num_micro_batches=opts.num_micro_batches,
        vocab_multiple=opts.vocab_multiple,
        lora=plan,
        overlap_grad_reduce=opts.overlap_grad_reduce,
        overlap_param_gather=opts.overlap_param_gather,
        head=model.head,
    )
    # A weak reference: autograd's C++ nodes (megatron's grad hooks) hold the parameters, and a
    # strong one would close a cycle through them that Python's gc cannot see, keeping the whole
    # model alive after its last use. The `Model` holds the placement.
    for p in gpt.parameters():
        setattr(p, PLACEMENT_ATTR, weakref.ref(placement))
    return placement


def model_placement(model: Model) -> MegatronPlacement:
    """`model`'s placement. Raises ``ValueError`` for a model not prepared by this backend."""
    placement = model.placement
    if not isinstance(placement, MegatronPlacement):
        raise ValueError(
            "this model is not prepared by the megatron backend; build it with "
            "backend='megatron' and initialise it with tf.init(model, tx, mesh)"
        )
    return placement


def _ensure_process_group(mesh: Mesh) -> None:
    if dist.is_initialized():
        return
    if mesh.world_size != 1:
        raise RuntimeError(
            f"{mesh} needs {mesh.world_size} processes joined by torch.distributed; launch with "
            "torchrun and call twinkle_fn.distributed.init_distributed() first"
        )
    # megatron-core needs a process group even on one process: an in-memory one-rank store.
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def _ensure_parallel_state(mesh: Mesh) -> None:
    if not parallel_state.model_parallel_is_initialized():
        parallel.initialize(mesh, seed=0)
        return
    live = dict(
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(),
        cp=parallel_state.get_context_parallel_world_size(),
        ep=parallel_state.get_expert_model_parallel_world_size(),
        etp=parallel_state.get_expert_tensor_parallel_world_size(),
        data=parallel_state.get_data_parallel_world_size(),
    )
    wanted = dict(
        tp=mesh.tp, pp=mesh.pp, cp=mesh.cp, ep=mesh.ep, etp=mesh.etp, data=mesh.data_world_size
    )
    if live != wanted:
        raise ValueError(
            f"megatron-core is initialised for {live}, but the mesh asks for {wanted}; call "
            "twinkle_fn.backends.megatron.parallel.destroy() before preparing a model on another mesh"
        )


def _ddp(gpt: torch.nn.Module, wrapped: torch.nn.Module, opts: Options) -> DistributedDataParallel:
    """megatron's DDP around `wrapped`: fp32 grad buffers laid out for the distributed
    optimizer in buckets of ``opts.grad_bucket_size`` elements (default: megatron's
    ``max(4e7, 1e6 * dp)`` with either overlap, else one bucket), each reduced during backward
    with ``opts.overlap_grad_reduce``, all of them when `step` asks otherwise; with
    ``opts.overlap_param_gather`` each bucket's parameters are gathered asynchronously."""
    dp_size = parallel_state.get_data_parallel_world_size(
        with_context_parallel=True, partial_data_parallel=True
    )
    bucket_size = opts.grad_bucket_size
    if bucket_size is None and (opts.overlap_grad_reduce or opts.overlap_param_gather):
        bucket_size = max(40_000_000, 1_000_000 * dp_size)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=opts.overlap_grad_reduce,
        overlap_param_gather=opts.overlap_param_gather,
        use_distributed_optimizer=True,
        bucket_size=bucket_size,
    )
    layout = DistributedOptimizer.compute_full_param_layout(
        [p for p in wrapped.parameters() if p.requires_grad],
        bucket_size,
        dp_size,
        ddp_config,
        expert_data_parallel_world_size=parallel_state.get_expert_data_parallel_world_size(
            partial_expert_data_parallel=True
        ),
    )
    return DistributedDataParallel(gpt.config, ddp_config, wrapped, full_param_layout=layout)
