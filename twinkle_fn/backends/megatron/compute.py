"""The megatron backend's forward and backward: megatron-core's schedule run on a batch's
micro-batches (`twinkle_fn.backends.megatron.train`), with an MoE model's router run around it.

`fwd_bwd` accumulates token-sum gradients in the DDP grad buffers and returns `Grads` viewing
them; `loss_of`, `token_logps`, `token_values` and `evaluate_logps` run the schedule without
backward. Per-token outputs come back merged into the batch's own layout on every pipeline
stage and context-parallel rank of a data shard. `MegatronBackend` (`backend.py`) calls these.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from megatron.core import parallel_state
from torch import Tensor

from twinkle_fn.backends.megatron import grad_sync, param_sync
from twinkle_fn.backends.megatron.lora_linear import adapters_off
from twinkle_fn.backends.megatron.micro_batch import merge_logps, micro_batches
from twinkle_fn.backends.megatron.optimizer import MegatronOptState
from twinkle_fn.backends.megatron.placement import MegatronPlacement, model_placement
from twinkle_fn.backends.megatron.router import RouterRun
from twinkle_fn.backends.megatron.train import forward_backward
from twinkle_fn.losses import LossOutput, TokenLoss
from twinkle_fn.models.families import family
from twinkle_fn.moe import ROUTED_EXPERTS, ROUTER_TOKEN, RouterLoss, router_loss, with_token_field
from twinkle_fn.state import Grads, TrainState


def loss_of(state: TrainState, batch: Mapping[str, Tensor]) -> LossOutput:
    """Token-summed loss and supervised-token count of `batch` (forward only, no graph).

    Runs megatron's schedule without backward; the result is the same on every pipeline
    stage. Raises ``ValueError`` as `twinkle_fn.backends.megatron.micro_batch.micro_batches` does.
    """
    out, _, _ = _forward_only(state, batch)
    return out


def fwd_bwd(
    state: TrainState,
    batch: Mapping[str, Tensor],
    accum: Grads | None,
    loss: TokenLoss | None,
) -> tuple[Grads, dict[str, Tensor]]:
    """Token-sum gradients of `batch`, accumulated in the DDP grad buffers.

    `loss` None is the default cross entropy (fused at tp 1); a `TokenLoss` runs on the last
    stage over `twinkle_fn.backends.megatron.token_terms`, its batch fields carried by every
    micro-batch. Without `accum` the buffers are zeroed first; with it, `accum` must be the `Grads` that
    owns them (the latest one, donated). Returns `Grads` whose tensors are views of the
    buffers and this call's ``loss_sum`` / ``num_tokens`` and ``logps`` (per-token
    ``log p(label)`` in `batch`'s layout, see `evaluate_logps`; a critic's are ``values``,
    its per-token values before the update). The views hold this rank's
    unreduced sums with ``overlap_grad_reduce=False``; with it (the default) the sums over
    data ranks on the part of each buffer this rank's optimizer reads (its shard under
    `megatron_optimizer`, all of it under a plain transform) and scratch elsewhere.
    Raises ``ValueError`` for a stale or copied `accum`, or a malformed batch;
    ``RuntimeError`` as `twinkle_fn.backends.megatron.grad_sync.finish_backward` does.
    """
    placement = model_placement(state.model)
    params = None if accum is None else live_grads(placement, accum, "fwd_bwd(accum=...)")
    batch, run = _router_run(state, batch, train=True)
    fields = (() if loss is None else tuple(loss.fields)) + (() if run is None else (ROUTER_TOKEN,))
    mbs = _micro_batches(placement, batch, fields)
    if placement.overlap_grad_reduce:
        # A plain transform reads whole gradients: all-reduce them rather than scatter.
        all_reduce = not isinstance(state.opt_state, MegatronOptState)
        grad_sync.begin_backward(
            placement.chunks, accumulate=accum is not None, all_reduce=all_reduce
        )
    elif accum is None:
        for chunk in placement.chunks:
            chunk.zero_grad_buffer()
    if params is None:
        params = {n: p.main_grad for n, p in state.params.items()}
        placement.live_grads = params
    try:
        loss_sum, num_tokens, per_token = forward_backward(
            placement.chunks,
            mbs,
            placement.hf_config.vocab_size,
            loss=loss,
            head=placement.head,
            router=run,
        )
    finally:
        routed = {} if run is None else run.end(mbs[0].labels.device)
    if placement.overlap_grad_reduce:
        grad_sync.finish_backward(placement.chunks)
    if placement.overlap_param_gather:
        param_sync.finish(placement.chunks)  # the forward waited for every gather
    key = "values" if placement.head == "value" else "logps"
    aux = {"loss_sum": loss_sum, "num_tokens": num_tokens, key: _merged(batch, mbs, per_token)}
    aux.update(routed)
    if accum is not None:
        loss_sum = accum.loss_sum + loss_sum
        num_tokens = accum.num_tokens + num_tokens
    done = 0 if accum is None else accum.num_micro_batches
    return Grads(params, loss_sum, num_tokens, num_micro_batches=done + len(mbs)), aux


def token_logps(
    state: TrainState,
    batch: Mapping[str, Tensor],
    *,
    temperature: float,
    disable_lora: bool,
    return_logits: bool,
    record_routing: bool = False,
) -> dict[str, Tensor]:
    """See `evaluate_logps`; `disable_lora` computes with the base weights alone
    (`twinkle_fn.backends.megatron.lora_linear.adapters_off`). Raises ``ValueError`` for a
    temperature other than 1 or logits, which megatron's fused loss path does not give."""
    if temperature != 1.0 or return_logits:
        raise ValueError(
            "the megatron backend gives log-probs at temperature 1, without logits (asked: "
            f"temperature={temperature}, return_logits={return_logits}); use the "
            "transformers backend"
        )
    chunks = model_placement(state.model).chunks
    with adapters_off(chunks) if disable_lora else contextlib.nullcontext():
        out, logps, record = _forward_only(state, batch, record_routing=record_routing)
    result = {"logps": logps, "loss_sum": out.loss_sum, "num_tokens": out.num_tokens}
    if record is not None:
        result[ROUTED_EXPERTS] = record
    return result


@torch.no_grad()
def token_values(state: TrainState, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A critic's per-token values of `batch`: megatron's schedule without backward, the
    values of the last stage's `twinkle_fn.backends.megatron.model.ValueHead` broadcast to
    every stage and merged back into `batch`'s layout (``[B, T]`` padded, ``[1, T]``
    packed; float32, 0 where the label is -100), the same on every pipeline stage and
    context-parallel rank of a data shard, and ``num_tokens``. A collective over the
    model's ranks. Raises ``ValueError`` as
    `twinkle_fn.backends.megatron.micro_batch.micro_batches` does."""
    placement = model_placement(state.model)
    mbs = _micro_batches(placement, batch)
    _, num_tokens, values = forward_backward(
        placement.chunks,
        mbs,
        placement.hf_config.vocab_size,
        forward_only=True,
        head=placement.head,
    )
    return {"values": _merged(batch, mbs, values), "num_tokens": num_tokens}


@torch.no_grad()
def evaluate_logps(state: TrainState, batch: Mapping[str, Tensor]) -> tuple[LossOutput, Tensor]:
    """``tf.evaluate`` of a megatron state that also returns the per-token log-probabilities.

    Runs megatron's schedule without backward. Returns the token-summed loss and supervised
    token count, and ``logps`` float32 in `batch`'s own layout (``[B, T]`` padded, ``[1, T]``
    packed): ``log p(label)`` of each token, 0 where the label is -100, the same on every
    pipeline stage and context-parallel rank of a data shard. A collective over the model's
    ranks. Raises ``DonatedError`` for a donated state, ``ValueError`` as
    `twinkle_fn.backends.megatron.micro_batch.micro_batches` does.
    """
    state.check_alive()
    out, logps, _ = _forward_only(state, batch)
    return out, logps


@torch.no_grad()
def _forward_only(
    state: TrainState, batch: Mapping[str, Tensor], *, record_routing: bool = False
) -> tuple[LossOutput, Tensor, Tensor | None]:
    """`evaluate_logps`' results and, with `record_routing`, the routing record of an MoE
    model (`twinkle_fn.moe`); a batch's ``routed_experts`` is replayed."""
    placement = model_placement(state.model)
    batch, run = _router_run(state, batch, train=False, record_routing=record_routing)
    mbs = _micro_batches(placement, batch, () if run is None else (ROUTER_TOKEN,))
    try:
        loss_sum, num_tokens, logps = forward_backward(
            placement.chunks,
            mbs,
            placement.hf_config.vocab_size,
            forward_only=True,
            router=run,
        )
        record = run.recorded(batch) if run is not None and record_routing else None
    finally:
        if run is not None:
            run.end(mbs[0].labels.device)
    return LossOutput(loss_sum, num_tokens), _merged(batch, mbs, logps), record


def _router_run(
    state: TrainState, batch: Mapping[str, Tensor], *, train: bool, record_routing: bool = False
) -> tuple[Mapping[str, Tensor], RouterRun | None]:
    """`batch` with `twinkle_fn.moe.ROUTER_TOKEN` and the `RouterRun` of an MoE model (its
    router losses when `train`), else `batch` and None. Raises ``ValueError`` for router
    losses, replay or recording with pipeline parallelism, and as
    `twinkle_fn.moe.with_token_field` does."""
    placement = model_placement(state.model)
    config = placement.hf_config
    batch = with_token_field(config, batch)
    if family(config).moe is None:
        return batch, None
    loss = router_loss(state.model.options, config) if train else RouterLoss()
    replay = batch.get(ROUTED_EXPERTS)
    if placement.mesh.pp > 1 and (loss.active or replay is not None or record_routing):
        raise ValueError(
            f"router losses, routing replay and recording need pp=1 on the megatron backend "
            f"(the mesh has pp={placement.mesh.pp}: a micro-batch's router statistics are "
            "summed between its forward and its backward); use pp=1, or "
            "router_loss={'aux_coef': 0, 'z_coef': 0} without routed_experts"
        )
    run = RouterRun(
        placement.module,
        config,
        loss,
        record=replay,
        record_routing=record_routing,
        sequence_parallel=placement.mesh.sequence_parallel,
    )
    return batch, run


def _merged(batch: Mapping[str, Tensor], mbs: list[Any], logps: list[Tensor]) -> Tensor:
    group = parallel_state.get_context_parallel_group()
    return merge_logps(batch, mbs, logps, cp_group=group if group.size() > 1 else None)


def _micro_batches(
    placement: MegatronPlacement, batch: Mapping[str, Tensor], fields: Sequence[str] = ()
) -> list[Any]:
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    return micro_batches(
        batch,
        placement.num_micro_batches,
        seq_multiple=placement.seq_multiple,
        cp_size=placement.mesh.cp,
        cp_rank=parallel_state.get_context_parallel_rank(),
        device=device,
        fields=fields,
    )


def live_grads(placement: MegatronPlacement, grads: Grads, where: str) -> dict[str, Tensor]:
    """`grads`' tensors, which must still be views of megatron's grad buffers (the `Grads` of
    the latest `fwd_bwd`, donated). Raises ``ValueError`` naming the caller `where` otherwise."""
    if grads.params is not placement.live_grads:
        raise ValueError(
            f"{where} got gradients that no longer own megatron's grad buffers (a later fwd_bwd "
            "or step reused them, or they are a copy); pass the Grads of the latest fwd_bwd, "
            "donated (donate=True)"
        )
    return grads.params
