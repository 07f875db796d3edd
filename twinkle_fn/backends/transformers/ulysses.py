"""DeepSpeed-Ulysses sequence parallelism on the transformers backend (the mesh's ``ulysses`` axis).

The ranks of a ulysses group hold the same data shard (the same batch, like cp peers). Each
keeps one contiguous slice of every row (`local_batch`: the sequence padded at its end to a
multiple of the group size, then cut), so embeddings, norms, MLP and the fused lm_head loss run
on ``seq / ulysses`` tokens. Rotary positions are the slice of the *global* position ids.
Attention (`attention_forward`, registered as `NAME`) turns query, key and value
``[B, heads, seq / u, dim]`` into ``[B, heads / u, seq, dim]`` by one all-to-all each, runs
`twinkle_fn.backends.transformers.attention.attention_forward` (SDPA, or the varlen kernel for a
packed row) over the whole sequence with the global padding mask or packed boundaries, and
turns the output back by another all-to-all. Heads and key/value heads (per tp rank) must
divide by the group size (`check_ulysses`).

Losses are token sums: each rank sums its slice's tokens and counts them, and the step sums
both over the data ranks *and* the ulysses group once (`fsdp.Placement.dp_group` spans both), so
the normalisation stays exact.

Parameters are replicated over ulysses (each rank holds what its fsdp/dp/tp coordinates give
it), and each micro-batch's gradients are summed over the ulysses group in `sum_grads` (data
parallelism for parameters: every rank saw other tokens of the same rows). We all-reduce
rather than fold ulysses into FSDP2's shard group so that a parameter's sharding stays one
`ShardSpec` per axis (`plans.param_specs`: `tf.shard`, checkpoints and weight export are
unchanged); the price is optimizer state replicated over ulysses and one gradient all-reduce
per micro-batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from transformers import AttentionInterface, PretrainedConfig
from transformers.masking_utils import AttentionMaskInterface

from twinkle_fn.backends.transformers import attention
from twinkle_fn.backends.transformers.linear_attention import has_linear_attention
from twinkle_fn.data import IGNORE_INDEX
from twinkle_fn.varlen_attention import block_causal_mask

NAME = "twinkle_ulysses"
# The global key-padding mask ``[B, seq]`` of a padded batch, handed to the attention.
KEY_MASK = "ulysses_key_mask"
_GROUP_ATTR = "ulysses_group"


def check_ulysses(config: PretrainedConfig, ulysses: int, tp: int, sequence_parallel: bool) -> None:
    """Refuse a model Ulysses cannot split: ``ValueError`` when `ulysses` does not divide the
    attention heads or key/value heads each tp rank holds, with Megatron-style
    ``sequence_parallel`` (both would split the sequence), for linear-attention layers (their
    recurrence needs the whole sequence, and only attention gathers it), or for an attention
    implementation other than SDPA."""
    if has_linear_attention(config):
        raise ValueError(
            f"mesh ulysses={ulysses} splits the sequence, but this model's linear-attention "
            "layers (config.layer_types) run a recurrence over the whole sequence, which "
            "Ulysses gathers for attention only; use ulysses=1 (tp, fsdp or dp for more ranks)"
        )
    if sequence_parallel:
        raise ValueError(
            f"mesh ulysses={ulysses} with sequence_parallel=True: both split the sequence; "
            "use one of them"
        )
    heads = config.num_attention_heads // tp
    kv_heads = getattr(config, "num_key_value_heads", config.num_attention_heads) // tp
    for what, n in (("attention heads", heads), ("key/value heads", kv_heads)):
        if n % ulysses:
            raise ValueError(
                f"mesh ulysses={ulysses} does not divide the {n} {what} of this model (per tp "
                f"rank, tp={tp}); Ulysses gives each rank heads / ulysses of them: use a "
                f"ulysses that divides {n}"
            )
    impl = config._attn_implementation
    if impl not in ("sdpa", attention.NAME, NAME):
        raise ValueError(
            f"mesh ulysses={ulysses} runs attention through SDPA, but this model uses "
            f"attn_implementation={impl!r}; load it with attn_implementation='sdpa'"
        )


def use_ulysses_attention(module: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Switch `module` (an HF decoder on SDPA) to `NAME` and give each attention layer `group`.

    Transformers builds no mask for `NAME` (its mask function returns None): masks are local
    to a slice there, and `attention_forward` builds the global one itself.
    """
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, _no_mask)
    module.set_attn_implementation(NAME)
    for layer in module.get_decoder().layers:
        setattr(layer.self_attn, _GROUP_ATTR, group)


def _no_mask(**_kwargs: Any) -> None:
    return None


def local_batch(batch: Mapping[str, Any], size: int, index: int) -> dict[str, Any]:
    """Rank `index`'s slice of every row of `batch` for a ulysses group of `size` ranks.

    Every tensor shaped like ``labels`` ``[B, T]`` (ids, labels, mask, positions, a loss's
    fields) is padded at its end to ``T'`` (a multiple of `size`; labels with -100, positions
    continuing, the rest with 0) and cut to its ``[B, T' / size]`` slice ``index``. Position
    ids are made when absent (per row, or per packed sample). What the attention needs of the
    whole row stays global: a packed row's ``cu_seqlens`` (the padding as one more sample) and
    ``max_seqlen``, a padded batch's ``attention_mask`` as `KEY_MASK` ``[B, T']`` when it masks
    anything.
    """
    labels = batch["labels"]
    rows, total = labels.shape
    pad = -total % size
    out = dict(batch)
    if "position_ids" not in batch:
        out["position_ids"] = _positions(batch, rows, total)
    if "cu_seqlens" in batch:
        cu = torch.as_tensor(batch["cu_seqlens"])
        if pad:
            cu = torch.cat([cu, cu[-1:] + pad])
            out["max_seqlen"] = max(int(batch.get("max_seqlen") or 0), pad)
        out["cu_seqlens"] = cu
    mask = batch.get("attention_mask")
    if mask is not None and "cu_seqlens" not in batch and not bool(mask.all()):
        out[KEY_MASK] = torch.nn.functional.pad(mask.bool(), (0, pad))
    out.pop("attention_mask", None)
    piece = (total + pad) // size
    for name, t in out.items():
        if isinstance(t, Tensor) and name != KEY_MASK and t.shape == labels.shape:
            out[name] = _pad(t, name, pad).narrow(1, index * piece, piece)
    return out


def _positions(batch: Mapping[str, Any], rows: int, total: int) -> Tensor:
    """``[B, T]`` position ids: ``0 .. T-1`` per row, or restarting at each packed sample."""
    if "cu_seqlens" not in batch:
        return torch.arange(total).expand(rows, total)
    cu = torch.as_tensor(batch["cu_seqlens"], dtype=torch.int64)
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])  # [T]
    return (torch.arange(total) - starts)[None]


def _pad(t: Tensor, name: str, pad: int) -> Tensor:
    """`t` ``[B, T]`` padded to ``[B, T + pad]``: -100 labels, continuing positions, else 0."""
    if not pad:
        return t
    if name == "position_ids":
        return torch.cat([t, t[:, -1:] + torch.arange(1, pad + 1, device=t.device)], dim=1)
    value = IGNORE_INDEX if name == "labels" else 0
    return torch.nn.functional.pad(t, (0, pad), value=value)


def model_inputs(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """The decoder's keyword arguments for a `local_batch`: the local ids and positions, and
    the global packed boundaries or key-padding mask for `attention_forward`."""
    kwargs: dict[str, Any] = {
        "input_ids": batch["input_ids"].to(device, non_blocking=True),
        "position_ids": batch["position_ids"].to(device, non_blocking=True),
    }
    if "cu_seqlens" in batch:
        max_len = batch.get("max_seqlen")
        max_len = int(max_len) if max_len is not None else None
        kwargs.update(attention.packed_kwargs(batch["cu_seqlens"], max_len, device))
    elif KEY_MASK in batch:
        kwargs[KEY_MASK] = batch[KEY_MASK].to(device, non_blocking=True)
    return kwargs


class _AllToAll(torch.autograd.Function):
    """All-to-all of equal chunks along dim 0 (``[group size, ...]``); its backward is the
    same all-to-all of the gradient (chunk i came from rank i, so its gradient goes back)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _all_to_all(grad, ctx.group), None


def _all_to_all(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def heads_to_sequence(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``[B, h, s, d]`` (all heads, this rank's slice) -> ``[B, h / u, u * s, d]`` (this rank's
    heads, the whole sequence) over a group of ``u`` ranks."""
    u = group.size()
    b, h, s, d = x.shape
    x = x.reshape(b, u, h // u, s, d).transpose(0, 1)  # [u (head group), B, h/u, s, d]
    x = _AllToAll.apply(x, group)  # [u (sequence slice), B, h/u, s, d]
    return x.permute(1, 2, 0, 3, 4).reshape(b, h // u, u * s, d)


def sequence_to_heads(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``[B, T, h / u, d]`` (this rank's heads, the whole sequence) -> ``[B, T / u, h, d]``
    (all heads, this rank's slice): the inverse of `heads_to_sequence`, in the attention
    output's layout."""
    u = group.size()
    b, t, hl, d = x.shape
    x = x.reshape(b, u, t // u, hl, d).transpose(0, 1)  # [u (sequence slice), B, s, h/u, d]
    x = _AllToAll.apply(x, group)  # [u (head group), B, s, h/u, d]
    return x.permute(1, 2, 0, 3, 4).reshape(b, t // u, u * hl, d)


@torch.compiler.disable
def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function protocol on this rank's slice: `query` ``[B, heads,
    s, dim]``, `key` / `value` ``[B, groups, s, dim]``; returns ``([B, s, heads, dim], None)``.

    `attention_mask` (local, None under `NAME`) is not read: a packed row's global
    ``cu_seq_lens_q`` in `kwargs` goes to the varlen path, a padded batch's global `KEY_MASK`
    ``[B, seq]`` makes the mask, else attention is plainly causal.
    """
    group = getattr(module, _GROUP_ATTR)
    q, k, v = (heads_to_sequence(t, group) for t in (query, key, value))
    key_mask = kwargs.pop(KEY_MASK, None)
    mask = None
    if "cu_seq_lens_q" not in kwargs and (key_mask is not None or sliding_window is not None):
        mask = _padded_mask(key_mask, q.shape[2], sliding_window, q.device)
    out, _ = attention.attention_forward(
        module, q, k, v, mask, dropout, scaling, sliding_window, **kwargs
    )
    return sequence_to_heads(out, group), None


def _padded_mask(
    key_mask: Tensor | None, total: int, window: int | None, device: torch.device
) -> Tensor:
    """bool ``[B or 1, 1, T, T]``: causal (within `window`), keys where `key_mask` ``[B, T]``
    holds; a query always sees itself, so a padding row is never empty (no NaN)."""
    cu = torch.tensor([0, total], device=device)
    allowed = block_causal_mask(cu, total, window)  # [1, 1, T, T]
    if key_mask is None:
        return allowed
    eye = torch.eye(total, dtype=torch.bool, device=device)
    return allowed & (key_mask[:, None, None, :] | eye)


def sum_grads(
    grads: dict[str, Tensor], accum: Mapping[str, Tensor] | None, group: dist.ProcessGroup
) -> dict[str, Tensor]:
    """This micro-batch's `grads` summed over the ulysses `group` (in place), then added into
    `accum`'s buffers when given (returned in their place). DTensor grads are reduced on their
    local shards: ulysses peers hold the same shard of each parameter."""
    for g in grads.values():
        dist.all_reduce(g.to_local() if isinstance(g, DTensor) else g, group=group)
    if accum is None:
        return grads
    for name, g in grads.items():
        accum[name].add_(g)
    return dict(accum)
