"""Packed rows through transformers' linear-attention layers (Qwen3.5's Gated DeltaNet).

A Gated DeltaNet layer runs a causal depthwise convolution and a recurrence along the sequence.
transformers' torch code for both runs over the whole row, so in a packed row a sample would
start from the previous sample's convolution window and recurrent state; its fla path restarts
the recurrence at ``cu_seqlens`` but not the convolution. `keep_samples_apart` makes each
linear-attention layer of a decoder restart both at the packed samples' boundaries, the same
``cu_seq_lens_q`` (`attention.packed_kwargs`) the attention reads:

- where fla's chunked gated delta rule and causal-conv1d's convolution are importable and the
  row is on a GPU, transformers' forward runs once on the whole row, with ``cu_seq_lens_q``
  (which it hands fla as ``cu_seqlens``) and the samples' ``seq_idx`` (which it hands the
  convolution);
- elsewhere (the torch code: any CPU, or a GPU without those kernels) transformers' forward runs
  on each sample's slice of the row, which is exactly that sample alone.

The seam is the layer's class (as `lm_head.fuse_lm_head` does for the head): the layer keeps its
parameters, names and transformers' forward, which the packed path calls.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch
from transformers import PretrainedConfig

# The decoder's keyword arguments that carry a packed row's boundaries (`attention.packed_kwargs`).
_PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
LINEAR_ATTENTION = "linear_attention"


def has_linear_attention(config: PretrainedConfig | None) -> bool:
    """Whether `config`'s decoder has linear-attention layers (``layer_types``)."""
    return LINEAR_ATTENTION in (getattr(config, "layer_types", None) or ())


def keep_samples_apart(module: torch.nn.Module) -> int:
    """Make every linear-attention layer of `module` (an HF causal LM) restart its convolution
    and recurrence at the packed samples' boundaries, in place (idempotent).

    Returns how many layers it adapted (0 for a decoder without linear attention). Raises
    ``ValueError`` when a layer that ``layer_types`` names linear attention has no
    ``linear_attn`` module.
    """
    config = getattr(module, "config", None)
    if not has_linear_attention(config):
        return 0
    adapted = 0
    for i, layer in enumerate(module.get_decoder().layers):
        if config.layer_types[i] != LINEAR_ATTENTION:
            continue
        mixer = getattr(layer, "linear_attn", None)
        if mixer is None:
            raise ValueError(
                f"decoder layer {i} is a {LINEAR_ATTENTION!r} layer (config.layer_types) but "
                f"has no linear_attn module ({type(layer).__name__}); twinkle cannot keep "
                "packed samples apart in it"
            )
        if not isinstance(mixer, PackedRows):
            mixer.__class__ = _packed_class(type(mixer))
        adapted += 1
    return adapted


class PackedRows(torch.nn.Module):
    """Mixed into a linear-attention layer's class by `keep_samples_apart`."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: Any = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """The layer's output ``[B, T, hidden]`` for `hidden_states` ``[B, T, hidden]``: the
        base class's forward, with a packed row (``cu_seq_lens_q`` ``[n + 1]`` in `kwargs`,
        ``B == 1``) computed sample by sample, or by the varlen kernels (see the module).

        Raises ``ValueError`` for a packed batch of more than one row, with a cache (packed
        rows are for training), or when ``cu_seq_lens_q`` does not end at ``T``.
        """
        base = super().forward
        if kwargs.get("cu_seq_lens_q") is None:
            return base(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        return _packed_forward(base, hidden_states, cache, attention_mask, kwargs)


# Outside a compiled layer's graph: it reads the boundaries on the host and slices the row into
# samples of changing lengths (a recompilation for each).
@torch.compiler.disable
def _packed_forward(
    base: Callable[..., torch.Tensor],
    hidden_states: torch.Tensor,
    cache: Any,
    attention_mask: torch.Tensor | None,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """`PackedRows.forward` of a packed row: `base` (transformers' forward) once with the
    varlen kernels, else on each sample's slice."""
    cu = kwargs["cu_seq_lens_q"]
    rows, total = hidden_states.shape[:2]
    if rows != 1:
        raise ValueError(f"a packed batch is one row of samples, got {rows} rows")
    if cache is not None:
        raise ValueError("a packed row (cu_seq_lens_q) runs without a cache; pass use_cache=False")
    if hidden_states.is_cuda and varlen_kernels():
        seq_idx = _sample_index(cu, total)  # [1, T]
        return base(hidden_states, attention_mask=attention_mask, seq_idx=seq_idx, **kwargs)
    # One host read of the boundaries per layer: the torch path loops over samples anyway.
    bounds = cu.tolist()
    if bounds[-1] != total:
        raise ValueError(
            f"cu_seq_lens_q ends at {bounds[-1]} but the packed row has {total} tokens; "
            "the boundaries must cover the row"
        )
    rest = {k: v for k, v in kwargs.items() if k not in _PACKED_KWARGS}
    outs = [
        base(
            hidden_states[:, start:end],
            attention_mask=None if attention_mask is None else attention_mask[:, start:end],
            **rest,
        )
        for start, end in itertools.pairwise(bounds)
        if end > start
    ]
    return torch.cat(outs, dim=1)


@functools.cache
def _packed_class(cls: type[torch.nn.Module]) -> type[torch.nn.Module]:
    """`cls` with `PackedRows` in front (one class per layer class, so instances share it)."""
    return type(f"Packed{cls.__name__}", (PackedRows, cls), {"__module__": __name__})


@functools.cache
def varlen_kernels() -> bool:
    """Whether the kernels transformers' Gated DeltaNet calls when they are importable take
    packed boundaries: fla's chunked gated delta rule (``cu_seqlens``) and causal-conv1d's
    convolution (``seq_idx``). transformers resolves its kernels once, at import, by the same
    imports."""
    try:
        from causal_conv1d import causal_conv1d_fn  # noqa: F401
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def _sample_index(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[1, total]`` int32: the index of the packed sample each token belongs to, from the
    boundaries ``[n + 1]`` (causal-conv1d's ``seq_idx``), computed on their device."""
    positions = torch.arange(total, device=cu_seqlens.device)
    index = torch.bucketize(positions, cu_seqlens[1:].to(torch.int64), right=True)
    return index.to(torch.int32)[None]
