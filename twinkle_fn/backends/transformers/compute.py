"""The transformers backend's forward/backward on one process.

The module computes with the state's own parameter tensors: `bind` points the module at them (a
pointer swap, no copy), so a state copied with ``donate=False`` trains its own tensors. The default
loss is the fused linear + cross-entropy of the model's `FusedLMHead`, so full ``[tokens, vocab]``
logits are never built. Any other loss (a `twinkle_fn.losses.TokenLoss`) runs on per-token
log-probabilities (and entropy) in float32, which the head computes chunk by chunk as well. A
value model (``Model.head == "value"``) hands its loss the per-token values of its ``score`` head.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig

from twinkle_fn.backends.transformers import attention, linear_attention, router, ulysses
from twinkle_fn.backends.transformers.lm_head import loss_mode, terms_mode
from twinkle_fn.data import IGNORE_INDEX
from twinkle_fn.data.packing import packed_attention_mask
from twinkle_fn.losses import LossOutput, TokenLoss, supervised_rows
from twinkle_fn.losses.cross_entropy import accumulation_dtype
from twinkle_fn.losses.token_loss import TokenInputs, apply_loss
from twinkle_fn.models.families import family
from twinkle_fn.models.model import Model
from twinkle_fn.moe import ROUTER_TOKEN, RouterPass, with_token_field
from twinkle_fn.state import LCG_INC, Grads, TrainState
from twinkle_fn.varlen_attention import block_causal_mask


def bind(module: torch.nn.Module, params: Mapping[str, torch.Tensor], sharded: bool) -> None:
    """Make `module`'s parameters named in `params` be exactly those tensor objects.

    A `sharded` module (FSDP2/DTensor) swaps its registered parameters in its own hooks and is
    always the owner of the state's tensors (copying a sharded state is refused), so it is left
    alone. Raises ``KeyError`` naming a parameter the module does not have.
    """
    if sharded:
        return
    for name, tensor in params.items():
        *path, leaf = name.split(".")
        owner = _submodule(module, path, name)
        if leaf not in owner._parameters:
            raise KeyError(f"the module has no parameter {name!r}")
        if owner._parameters[leaf] is not tensor:
            owner._parameters[leaf] = tensor


def _submodule(module: torch.nn.Module, path: list[str], name: str) -> torch.nn.Module:
    """The submodule of `module` at `path` (the parts of a dotted name), read from the
    ``_modules`` dicts: ``get_submodule``'s ``hasattr`` / ``getattr`` per level cost ~10 us a
    parameter, and a LoRA model binds hundreds before every forward, while the GPU waits. Raises
    ``KeyError`` naming the parameter `name` when a level is missing."""
    for part in path:
        child = module._modules.get(part)
        if child is None:
            raise KeyError(f"the module has no parameter {name!r}")
        module = child
    return module


def cast_residual_stream(module: torch.nn.Module) -> None:
    """Under autocast, make the input embedding return the autocast dtype (idempotent).

    Autocast casts matmul inputs but leaves elementwise ops alone, so float32 master weights
    would make the residual stream, and with it every norm, rotary and residual add and the
    activations saved for them, float32. FSDP2's mixed precision runs those in bf16 already
    (it casts the parameters); this gives one process the same numerics and the halved bytes.
    Outside autocast the embedding is untouched.
    """
    embedding = module.get_input_embeddings()
    if getattr(embedding, "_twinkle_casts_output", False):
        return
    embedding.register_forward_hook(_to_autocast_dtype)
    embedding._twinkle_casts_output = True


def _to_autocast_dtype(
    _module: torch.nn.Module, _args: tuple[object, ...], out: torch.Tensor
) -> torch.Tensor:
    """``out`` ``[batch, seq, hidden]`` in the autocast dtype when autocast is on."""
    kind = out.device.type
    if torch.is_autocast_enabled(kind) and out.is_floating_point():
        return out.to(torch.get_autocast_dtype(kind))
    return out


def model_inputs(
    batch: Mapping[str, torch.Tensor],
    device: torch.device,
    config: PretrainedConfig | None = None,
) -> dict[str, Any]:
    """The keyword arguments of a transformers decoder for a padded or packed `batch`.

    Padded batches pass their ``attention_mask [B, T]`` and ``position_ids [B, T]``. When both
    are on the host and say nothing beyond causal attention (no padding, each row's positions
    ``0 .. T-1``), neither is passed: the decoder's defaults give the same result, and
    transformers would otherwise inspect them on the device (for padding, or for packed
    sequences), a host sync in every forward that lets the GPU run dry while the host catches
    up. Without them transformers still inspects the positions it makes itself; a decoder whose
    family has `Family.mask_mapping` (by `config`), with full attention in every layer, is handed
    its masks instead, ``{"full_attention": None}`` (SDPA's own causal mask), which skips that.
    A packed row (with ``cu_seqlens``) for a decoder on `attention.NAME` passes its
    boundaries (`attention.packed_kwargs`), so its attention runs a varlen kernel, and a
    mask transformers need not build (the mapping above, or one made on the device from the
    boundaries, which the varlen kernel does not read). Other packed batches get a
    block-diagonal causal ``[1, 1, T, T]`` mask, since transformers' SDPA path does not
    isolate packed samples from ``position_ids`` alone, and a decoder with linear-attention
    layers the boundaries as well (`linear_attention.keep_samples_apart` reads them). Raises
    ``ValueError`` for a packed batch of a family that cannot keep packed samples apart
    (`Family.packed_rows`).
    """
    if "cu_seqlens" in batch and config is not None:
        _check_packable(config)
    ids = batch["input_ids"].to(device, non_blocking=True)  # [B, T]
    kwargs: dict[str, Any] = {"input_ids": ids}
    if "cu_seqlens" not in batch and _plainly_causal(batch, ids.shape[-1]):
        if config is not None and _takes_causal_mapping(config):
            kwargs["attention_mask"] = {"full_attention": None}
        return kwargs
    if "position_ids" in batch:
        kwargs["position_ids"] = batch["position_ids"].to(device, non_blocking=True)
    if "cu_seqlens" in batch and _takes_packed_kwargs(config, ids):
        kwargs.update(attention.packed_kwargs(batch["cu_seqlens"], _max_seqlen(batch), device))
        causal_mapping = _takes_causal_mapping(config)
        # The varlen path reads no mask; a tensor (or a mapping) stops transformers building one.
        kwargs["attention_mask"] = (
            {"full_attention": None}
            if causal_mapping
            else block_causal_mask(kwargs["cu_seq_lens_q"], ids.shape[-1])
        )
    elif "cu_seqlens" in batch:
        mask = packed_attention_mask(batch["cu_seqlens"], ids.shape[-1])
        kwargs["attention_mask"] = _as_attention_takes(mask, config).to(device, non_blocking=True)
        if linear_attention.has_linear_attention(config):
            # the mask keeps the attention layers' samples apart, not the linear-attention ones
            kwargs.update(attention.packed_kwargs(batch["cu_seqlens"], _max_seqlen(batch), device))
    elif "attention_mask" in batch:
        kwargs["attention_mask"] = batch["attention_mask"].to(device, non_blocking=True)
    return kwargs


def _as_attention_takes(mask: torch.Tensor, config: PretrainedConfig | None) -> torch.Tensor:
    """`mask` (bool, True where a query may attend a key) as `config`'s attention reads a
    ready-made 4-D mask: transformers' eager attention adds it to the scores, so it needs 0
    and a large negative value, not True and False (which it would add as 1 and 0, masking
    nothing); SDPA and the others take the booleans."""
    if config is None or getattr(config, "_attn_implementation", None) != "eager":
        return mask
    # float32: the scores it is added to are float32 or promote to it (bf16 + float32).
    blocked = torch.finfo(torch.float32).min
    return torch.zeros(mask.shape).masked_fill_(~mask, blocked)


def _check_packable(config: PretrainedConfig) -> None:
    row = family(config)
    if row.packed_rows is not None:
        raise ValueError(
            f"packed rows (batch['cu_seqlens']) are not supported for model family "
            f"{row.name!r}: {row.packed_rows}. Use padded batches "
            "(twinkle_fn.data.pad_collate) for it."
        )


def local_batch(model: Model, batch: Mapping[str, Any]) -> Mapping[str, Any]:
    """`batch` as this rank computes it: its slice of every row under ulysses
    (`ulysses.local_batch`), else `batch` itself."""
    placement = model.placement
    group = None if placement is None else placement.ulysses_group
    if group is None:
        return batch
    return ulysses.local_batch(batch, group.size(), group.rank())


def decoder_inputs(model: Model, batch: Mapping[str, Any]) -> dict[str, Any]:
    """`model_inputs` of `batch` (a `local_batch`) on the model's device, or under ulysses
    `ulysses.model_inputs`."""
    if model.placement is not None and model.placement.ulysses_group is not None:
        return ulysses.model_inputs(batch, model.device)
    return model_inputs(batch, model.device, model.module.config)


def _takes_packed_kwargs(config: PretrainedConfig | None, ids: torch.Tensor) -> bool:
    """Whether a packed row goes to `attention`'s varlen path: the decoder runs
    `attention.NAME` and the batch is one row."""
    impl = None if config is None else config._attn_implementation
    return impl == attention.NAME and ids.shape[0] == 1


def _max_seqlen(batch: Mapping[str, Any]) -> int | None:
    """The batch's ``max_seqlen`` as a host int (`twinkle_fn.data.pack` adds it), else None."""
    value = batch.get("max_seqlen")
    if isinstance(value, torch.Tensor):
        return int(value) if value.device.type == "cpu" else None
    return value


def _takes_causal_mapping(config: PretrainedConfig) -> bool:
    """Whether `config`'s decoder takes ``{"full_attention": None}`` as all its masks."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    full = set(layer_types) == {"full_attention"}
    return full and family(config).mask_mapping


def _plainly_causal(batch: Mapping[str, torch.Tensor], seq: int) -> bool:
    """Whether `batch`'s mask and positions are on the host (free to read) and add nothing to
    causal attention over positions ``0 .. seq-1``."""
    mask, positions = batch.get("attention_mask"), batch.get("position_ids")
    on_host = all(t is None or t.device.type == "cpu" for t in (mask, positions))
    if not on_host:
        return False
    no_padding = mask is None or bool(mask.all())
    return no_padding and (positions is None or bool((positions == torch.arange(seq)).all()))


def autocast(model: Model) -> contextlib.AbstractContextManager[object]:
    """Autocast to the model's compute dtype on its device (nothing for float32)."""
    if model.compute_dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(model.device.type, dtype=model.compute_dtype)


def loss_of(
    state: TrainState,
    batch: Mapping[str, torch.Tensor],
    loss: TokenLoss | None = None,
    rp: RouterPass | None = None,
) -> LossOutput:
    """Token-summed loss of `batch` under `state` (differentiable w.r.t. its params).

    The default cross entropy (`loss` None) runs the module's own forward with its `FusedLMHead`
    in loss mode, so the head returns the CE sum instead of logits. The supervised tokens are
    found before the forward is queued: free for CPU labels, and for device labels the one sync
    lands where the device has no work queued behind it rather than mid-step. Another `loss`
    gets float32 per-token terms from the head in terms mode (no full logits either) and the
    batch fields it reads; on a value model it gets the per-token values (`token_values`).
    An MoE model's routers feed `rp` (`twinkle_fn.backends.transformers.router`) and replay
    ``batch["routed_experts"]`` when present.
    """
    model = state.model
    if ROUTER_TOKEN not in batch:
        batch = with_token_field(model.config, batch)
    batch = local_batch(model, batch)
    # fwd_bwd's routing outlives the forward: checkpointed layers recompute in the backward
    with router.routing(model, rp, batch, keep=rp is not None):
        return _loss_of(state, batch, loss)


def _loss_of(
    state: TrainState, batch: Mapping[str, torch.Tensor], loss: TokenLoss | None
) -> LossOutput:
    """`loss_of` of a local batch."""
    model = state.model
    module = model.module
    bind(module, state.params, sharded=model.placement is not None)
    device = model.device
    if model.head == "value":
        return _value_loss_of(state, batch, loss)
    if loss is not None:
        return _token_loss_of(model, batch, loss)
    rows = supervised_rows(batch["labels"], IGNORE_INDEX, device)  # [supervised tokens]
    labels = batch["labels"].to(device, non_blocking=True)  # [B, T], already shifted
    with autocast(model), loss_mode(module.get_output_embeddings(), labels, rows):
        inputs = decoder_inputs(model, batch)
        loss_sum = module(**inputs, use_cache=False).logits
    return LossOutput(loss_sum, (labels != IGNORE_INDEX).sum())


def _token_loss_of(model: Model, batch: Mapping[str, torch.Tensor], loss: TokenLoss) -> LossOutput:
    """`loss` of the per-token log-probabilities (and entropy) of the (already bound) module,
    which its `FusedLMHead` computes chunk by chunk in `terms_mode`: no ``[B, T, vocab]``
    logits."""
    device = model.device
    rows = supervised_rows(batch["labels"], IGNORE_INDEX, device)  # [supervised tokens]
    labels = batch["labels"].to(device, non_blocking=True)  # [B, T], already shifted
    fields = {name: batch[name].to(device, non_blocking=True) for name in loss.fields}
    with_entropy = "entropy" in loss.needs
    head = model.module.get_output_embeddings()
    with autocast(model), terms_mode(head, labels, rows, with_entropy=with_entropy):
        inputs = decoder_inputs(model, batch)
        terms = model.module(**inputs, use_cache=False).logits  # [B, T, 2]
    entropy = terms[..., 1] if with_entropy else None
    return apply_loss(loss, TokenInputs(terms[..., 0], labels, fields, entropy))


def token_values(state: TrainState, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``[B, T]`` (``[1, T]`` packed) per-token values of a value model's ``score`` head,
    differentiable, in float32 (float64 for a float64 model), 0 where the label is -100.

    The value at a token is read from the hidden state that predicts its label, so it is the
    value of the state in which that token was chosen, aligned with its log-probability.
    """
    model = state.model
    bind(model.module, state.params, sharded=model.placement is not None)
    device = model.device
    labels = batch["labels"].to(device, non_blocking=True)  # [B, T], already shifted
    with autocast(model):
        inputs = decoder_inputs(model, batch)
        scores = model.module(**inputs, use_cache=False).logits  # [B, T, 1]
    values = scores[..., 0].to(accumulation_dtype(scores.dtype))  # [B, T]
    # where, not a product: a non-finite value on an ignored token must not leak in
    return torch.where(labels != IGNORE_INDEX, values, 0.0)


def _value_loss_of(
    state: TrainState, batch: Mapping[str, torch.Tensor], loss: TokenLoss
) -> LossOutput:
    """`loss` of a value model's per-token values (`token_values`) and the fields it reads."""
    device = state.model.device
    labels = batch["labels"].to(device, non_blocking=True)  # [B, T]
    fields = {name: batch[name].to(device, non_blocking=True) for name in loss.fields}
    values = token_values(state, batch)  # [B, T]
    return apply_loss(loss, TokenInputs(None, labels, fields, values=values))


def fwd_bwd(
    state: TrainState,
    batch: Mapping[str, torch.Tensor],
    accum: Grads | None,
    loss: TokenLoss | None = None,
) -> tuple[Grads, dict[str, torch.Tensor]]:
    """Gradients of the token-summed loss of `batch`, added into `accum`'s buffers if given.

    `loss`: see `loss_of`. `accum` is consumed (its buffers become the result's); the caller
    handles donation. Returns the new `Grads` and ``{"loss_sum", "num_tokens"}`` of this
    micro-batch alone (under ulysses: of this rank's slice of it); an MoE model adds
    `twinkle_fn.moe.RouterPass.info` (``expert_load``, and ``aux_loss`` / ``z_loss`` when
    trained: their gradients join the loss's, weighted by this micro-batch's token count).
    """
    params = state.params
    micro_index = 0 if accum is None else accum.num_micro_batches
    placement = state.model.placement
    group = None if placement is None else placement.ulysses_group
    for name, p in params.items():
        # under ulysses this micro-batch's gradients are summed over the group before they join
        # `accum` (which holds sums already)
        p.grad = None if accum is None or group is not None else accum.params[name]
    ls = state.loss_scale  # float16: scale up so small gradients do not underflow
    rp = router.new_pass(state.model)
    try:
        with _seeded(state.rng, micro_index, state.model.device):
            out = loss_of(state, batch, loss, rp)
        if rp is not None:
            if ls is not None:
                rp.grad_scale = lambda: float(ls.scale)
            rp.finish(out.num_tokens.detach(), _dp_all_reduce(placement))
        (out.loss_sum if ls is None else out.loss_sum * float(ls.scale)).backward()
        grads = {n: _grad_like(p) for n, p in params.items()}
        if group is not None:
            grads = ulysses.sum_grads(grads, None if accum is None else accum.params, group)
    finally:
        router.release(state.model)
        for p in params.values():
            p.grad = None
    loss_sum = out.loss_sum.detach()
    num_tokens = out.num_tokens.detach()
    if accum is not None:
        loss_sum = accum.loss_sum + loss_sum
        num_tokens = accum.num_tokens + num_tokens
    new = Grads(grads, loss_sum, num_tokens, num_micro_batches=micro_index + 1)
    info = {"loss_sum": out.loss_sum.detach(), "num_tokens": out.num_tokens.detach()}
    if rp is not None:
        info.update(rp.info())
    return new, info


def _dp_all_reduce(placement: Any) -> Any:
    """An in-place sum over the ranks holding other tokens (None on one process)."""
    group = None if placement is None else placement.dp_group
    if group is None:
        return None
    return lambda t: torch.distributed.all_reduce(t, group=group)


def _grad_like(p: torch.Tensor) -> torch.Tensor:
    """`p`'s gradient, placed like `p`: zeros when unused, and a sequence-parallel norm's
    partial sums (each rank saw its slice of the sequence) reduced to the replicated total."""
    g = p.grad
    if g is None:
        return torch.zeros_like(p)
    if isinstance(g, DTensor) and g.placements != p.placements:
        g = g.redistribute(p.device_mesh, p.placements)
    return g


@contextlib.contextmanager
def _seeded(rng: torch.Tensor, micro_index: int, device: torch.device) -> Iterator[None]:
    """Seed torch's generators from the state's key and the micro-batch index, then restore them."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        seed = (int(rng) + micro_index * LCG_INC) % (1 << 63)
        torch.manual_seed(seed)
        yield
