"""Parameter all-gathers after the distributed optimizer's step, overlapped with the next forward.

Under megatron's distributed optimizer each data rank updates its own shard of every bucket; the
other ranks' shards reach it by an all-gather of the bucket's parameter buffer. Without overlap
``optimizer.step()`` runs these all-gathers synchronously. With the DDP's
``overlap_param_gather`` the optimizer leaves them to us: `start` dispatches every bucket's
all-gather asynchronously right after the step, in the order the forward uses the buckets, and the
DDP's forward pre-hooks make the compute stream wait for a bucket only when the first module that
uses it runs. The gathers then fill the idle time at the step boundary and overlap the forward's
first layers (megatron's own default dispatches each bucket only when the previous one is
reached).

Until a bucket's gather is waited for, the parameters it covers hold stale values of the other
ranks' shards. A forward waits by itself; every other reader or writer of the parameters
(unsharding, checkpoints, offload, a new optimizer's ``init``) calls `finish` first.

Bookkeeping: a bucket group's ``param_gather_dispatched`` tells the pre-hook whether the group's
parameters still need gathering. megatron resets it whenever a gradient reduction finishes,
expecting an optimizer step; between accumulating calls, and after a step that updated whole
parameters on every rank, nothing needs gathering, which `finish` records.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron.core.distributed import DistributedDataParallel

from twinkle_fn.backends.megatron.grad_sync import bucket_groups

__all__ = ["enable", "finish", "in_flight", "start"]


def enable(chunk: DistributedDataParallel) -> None:
    """Set `chunk` (a DDP built with ``overlap_param_gather=True``) up for `start` / `finish`.

    Its pre-hooks then only wait for a bucket's gather: `start` has dispatched them all. The
    freshly loaded parameters are the same on every data rank, so nothing needs gathering yet.
    Raises ``ValueError`` for a DDP without ``overlap_param_gather``.
    """
    if not chunk.ddp_config.overlap_param_gather:
        raise ValueError(
            "param_sync needs DistributedDataParallelConfig(overlap_param_gather=True)"
        )
    # megatron's name for "all gathers were dispatched after the step": the pre-hook then
    # never dispatches the next bucket's gather itself.
    chunk.overlap_param_gather_with_optimizer_step = True
    finish([chunk])


def start(chunks: Sequence[DistributedDataParallel]) -> None:
    """Dispatch every bucket's parameter all-gather asynchronously (after the optimizer wrote
    this rank's shards into the parameter buffers), in the order the forward needs them. A
    collective over the data ranks."""
    finish(chunks)
    for chunk in chunks:
        for groups in (chunk.bucket_groups, chunk.expert_parallel_bucket_groups):
            # megatron lays buckets out in backward order: the forward needs the last one first,
            # and a communicator runs its gathers one after another
            for group in reversed(groups):
                group.start_param_sync()


def finish(chunks: Sequence[DistributedDataParallel]) -> None:
    """Wait for every in-flight parameter all-gather and mark all parameters current.

    On NCCL the wait orders the current stream after the gathers without blocking the host.
    Idempotent; no collective is started.
    """
    for group in bucket_groups(chunks):
        if group.param_gather_handle is not None:
            group.param_gather_handle.wait()
            group.param_gather_handle = None
        group.param_gather_dispatched = True


def in_flight(chunks: Sequence[DistributedDataParallel]) -> int:
    """How many bucket groups have a parameter all-gather dispatched and not yet waited for."""
    return sum(group.param_gather_handle is not None for group in bucket_groups(chunks))
