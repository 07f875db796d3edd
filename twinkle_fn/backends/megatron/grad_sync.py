"""Data-parallel gradient reduction overlapped with backward, exact across accumulating calls.

With ``DistributedDataParallelConfig(overlap_grad_reduce=True)`` megatron's DDP reduces each
gradient bucket as soon as the backward of a call's last micro-batch has produced all of its
gradients (megatron's schedule keeps the earlier micro-batches out through ``config.no_sync_func``):
a reduce-scatter into this rank's shard of the bucket under the distributed optimizer's layout, or
an all-reduce of the whole bucket, asynchronously and in place in the fp32 grad buffer.

A second call that accumulates into the same buffers (``fwd_bwd(accum=...)``) must not reduce the
first call's already-reduced values again. `begin_backward` therefore zeroes every part of each
bucket except the one that holds this rank's reduced sum (its own shard for a reduce-scatter; the
whole bucket on the group's first rank for an all-reduce): the next reduction then adds the
earlier sum exactly once, ``R(g1) + g2_local`` from one rank and ``g2_local`` from every other,
with no extra memory. `finish_backward` waits for (or starts) every bucket's reduction, so that no
collective is in flight when a call returns.

The result equals the reduction of the summed local gradients up to the order of the additions;
the parts of the buffer other ranks own hold scratch values (only this rank's part is read by
megatron's optimizer; the whole buffer by an all-reduce's reader).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.param_and_grad_buffer import shard_buffer

__all__ = ["begin_backward", "bucket_groups", "check_overlappable", "finish_backward"]


def bucket_groups(chunks: Sequence[DistributedDataParallel]) -> Iterator[Any]:
    """Every bucket group of `chunks`' DDPs, dense then expert-parallel, in megatron's (backward)
    order."""
    for chunk in chunks:
        yield from chunk.bucket_groups
        yield from chunk.expert_parallel_bucket_groups


def check_overlappable(chunk: DistributedDataParallel) -> None:
    """Raise ``ValueError`` unless `chunk`'s DDP reduces with overlap in a way this module keeps
    exact: ``overlap_grad_reduce`` and the distributed optimizer's layout on, one optimizer
    instance, and every gradient accumulated in the grad buffer itself."""
    cfg = chunk.ddp_config
    if not (cfg.overlap_grad_reduce and cfg.use_distributed_optimizer):
        raise ValueError(
            "grad_sync needs DistributedDataParallelConfig(overlap_grad_reduce=True, "
            "use_distributed_optimizer=True)"
        )
    if cfg.num_distributed_optimizer_instances != 1:
        raise ValueError(
            "overlap_grad_reduce=True supports one distributed-optimizer instance, got "
            f"{cfg.num_distributed_optimizer_instances}; set overlap_grad_reduce=False"
        )
    for group in bucket_groups([chunk]):
        if any(b.params_with_extra_main_grads for b in group.buckets):
            raise ValueError(
                "overlap_grad_reduce=True needs every gradient accumulated in megatron's grad "
                "buffer, but some parameters keep a separate main_grad (quantized parameter "
                "storage); set overlap_grad_reduce=False"
            )


def begin_backward(
    chunks: Sequence[DistributedDataParallel], *, accumulate: bool, all_reduce: bool
) -> None:
    """Prepare `chunks`' grad buffers for a backward whose reductions overlap it.

    Without `accumulate` the buffers are zeroed (``zero_grad_buffer``). With it they must hold a
    finished reduction of the same kind (`finish_backward`); each bucket keeps only this rank's
    reduced part. `all_reduce`: all-reduce whole buckets (replicated gradients, as a
    ``twinkle_fn.optim`` transform needs) instead of reduce-scattering them. Raises
    ``ValueError`` when accumulating onto a reduction of the other kind.
    """
    for chunk in chunks:
        if accumulate and chunk.force_all_reduce != all_reduce:
            raise ValueError(
                "these gradients were reduced for another optimizer kind (all-reduce vs. "
                "reduce-scatter); accumulate with the state that produced them"
            )
        chunk.force_all_reduce = all_reduce
        if not accumulate:
            # A call that raised mid-backward may have left a reduction in flight.
            for group in bucket_groups([chunk]):
                if group.grad_reduce_handle is not None:
                    group.grad_reduce_handle.wait()
                    group.grad_reduce_handle = None
            chunk.zero_grad_buffer()
    if not accumulate:
        return
    with torch.no_grad():
        for group in bucket_groups(chunks):
            size = group.intra_distributed_optimizer_instance_size
            rank = group.intra_distributed_optimizer_instance_rank
            for bucket in group.buckets:
                if all_reduce:
                    if rank != 0:
                        bucket.grad_data.zero_()
                    continue
                for i, shard in enumerate(shard_buffer(bucket.grad_data, size)):
                    if i != rank:
                        shard.zero_()
            # Per-call bookkeeping (gradients seen, reduction finished); keeps the buffer.
            group.reset()


def finish_backward(chunks: Sequence[DistributedDataParallel]) -> None:
    """Complete every bucket's reduction after a backward (a collective on the data ranks).

    A bucket that the backward did not dispatch (the first call ever, which learns how many
    gradients each parameter receives, or a call whose parameters received fewer) is reduced
    now. Raises ``RuntimeError`` when a bucket was reduced before all of its gradients arrived
    (a parameter received more gradients than in the first call: the graph changed between
    calls); its gradients are then wrong, and the model needs ``overlap_grad_reduce=False``.
    """
    early = []
    for chunk in chunks:
        for group in bucket_groups([chunk]):
            if group.grad_reduce_finished:
                continue
            if not group.is_first_batch:
                if group.grad_reduce_handle is None:
                    group.start_grad_sync(force_all_reduce=chunk.force_all_reduce)
                elif group.per_param_grad_ready_counts != group.golden_per_param_grad_ready_counts:
                    early.append(group)
            group.finish_grad_sync(force_all_reduce=chunk.force_all_reduce)
    if early:
        raise RuntimeError(
            f"{len(early)} gradient bucket(s) were reduced before all of their gradients arrived: "
            "some parameter received more gradients in this backward than in the first one "
            "(the graph changed between calls); these gradients are wrong. Build the model with "
            "options={'overlap_grad_reduce': False}"
        )
