"""HF -> megatron-core: one rank's local megatron-core state from HF checkpoint tensors.

`hf_to_mcore` (and `iter_hf_to_mcore`, its lazy form) walks the family's table
(`twinkle_fn.backends.megatron.bridge_rules`) over one rank's stage and expert-parallel rank
(`twinkle_fn.backends.megatron.bridge_layout`) and reads, for each megatron tensor, only the rows
of its HF tensors that rank holds, fusing q/k/v and gate/up and padding the vocabulary
(`twinkle_fn.backends.megatron.bridge_transforms`). The HF tensors come from a `SliceSource`
(partial reads, e.g. `twinkle_fn.backends.megatron.safetensors_io.SafetensorsReader`), or from a
mapping or a getter of whole tensors. A missing or misshapen HF tensor raises a ``ValueError``
naming it. `twinkle_fn.backends.megatron.bridge` describes the layout conventions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Protocol, runtime_checkable

import torch
from transformers import PretrainedConfig

from twinkle_fn.backends.megatron.bridge_layout import (
    _etp_rank,
    _Layout,
    _layout,
    _Model,
    _rank,
    _Slot,
    _slots,
)
from twinkle_fn.backends.megatron.bridge_transforms import (
    even_range,
    fuse_gate_up,
    fuse_qkv,
    group_query_gate,
    pad_vocab,
    padded_vocab_size,
)


@runtime_checkable
class SliceSource(Protocol):
    """A source of HF tensors that can read part of a tensor (e.g. `SafetensorsReader`)."""

    def shape(self, name: str) -> tuple[int, ...]:
        """The full shape of `name`; ``KeyError`` if absent."""
        ...

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor `name`; ``KeyError`` if absent."""
        ...

    def get_rows(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Indices ``[start, stop)`` of `name` along `dim`."""
        ...


class _TensorSource:
    """A `SliceSource` over whole tensors: a mapping or a getter, called once per tensor read."""

    def __init__(self, lookup: Callable[[str], torch.Tensor]) -> None:
        self._lookup = lookup
        self._last: tuple[str, torch.Tensor] | None = None

    def get(self, name: str) -> torch.Tensor:
        # Reading a tensor asks for its shape, then its rows: keep the last one for the second call.
        if self._last is None or self._last[0] != name:
            self._last = (name, self._lookup(name).detach())
        return self._last[1]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.get(name).shape)

    def get_rows(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return self.get(name).narrow(dim, start, stop - start)


HFState = Mapping[str, torch.Tensor] | Callable[[str], torch.Tensor] | SliceSource


def _source(hf_state: HFState) -> SliceSource:
    if isinstance(hf_state, SliceSource):
        return hf_state
    if isinstance(hf_state, Mapping):
        return _TensorSource(hf_state.__getitem__)
    if callable(hf_state):
        return _TensorSource(hf_state)
    raise TypeError(
        f"hf_state is a {type(hf_state).__name__}; pass a mapping of HF names to tensors, a "
        "getter name -> tensor, or a SafetensorsReader"
    )


def _missing(name: str) -> ValueError:
    hint = ""
    if ".mlp.experts." in name:
        hint = (
            " The bridge reads checkpoint (on-disk) names with one tensor per expert; an in-memory"
            " transformers state_dict fuses experts into mlp.experts.gate_up_proj: save it with"
            " save_pretrained and read it with SafetensorsReader."
        )
    return ValueError(f"HF tensor {name!r} is missing from hf_state.{hint}")


def _shape(src: SliceSource, name: str) -> tuple[int, ...]:
    try:
        return tuple(src.shape(name))
    except KeyError:
        raise _missing(name) from None


def _length(src: SliceSource, name: str, dim: int, expect: int | None = None) -> int:
    shape = _shape(src, name)
    if dim >= len(shape):
        raise ValueError(f"HF tensor {name!r} has shape {list(shape)}, which has no dim {dim}")
    if expect is not None and shape[dim] != expect:
        raise ValueError(
            f"HF tensor {name!r} has shape {list(shape)}; expected {expect} along dim {dim} "
            "(from the config and the tensors fused with it). Check that config and weights match."
        )
    return shape[dim]


def _span(name: str, n: int, rank: int, size: int) -> tuple[int, int]:
    try:
        return even_range(n, rank, size)
    except ValueError as err:
        raise ValueError(
            f"cannot split {name!r} over {size} tensor-parallel ranks: {err}"
        ) from None


def _import_qkv(src: SliceSource, slot: _Slot, model: _Model, rank: int, size: int) -> torch.Tensor:
    # A rank's rows of the fused tensor cover whole query groups (or, with fewer kv heads than
    # ranks, part of one group): read the q/k/v rows of the groups it touches, fuse, then cut.
    # A gated q_proj's queries and gates are fused as twice the query heads.
    hd, kv = model.head_dim, model.kv_heads
    per = model.heads // kv
    gated = slot.rule.transform == "gated_qkv"
    q_heads = 2 * per if gated else per
    group = (q_heads + 2) * hd
    start, stop = _span(slot.mcore, kv * group, rank, size)
    g0, g1 = start // group, -(-stop // group)
    parts = []
    for name, heads_per_group in zip(slot.hf, (q_heads, 1, 1), strict=True):
        rows = heads_per_group * hd
        _length(src, name, 0, kv * rows)
        parts.append(src.get_rows(name, 0, g0 * rows, g1 * rows))
    if gated:
        parts[0] = group_query_gate(parts[0], per, hd)
    fused = fuse_qkv(*parts, (g1 - g0) * q_heads, g1 - g0, hd)
    lo, hi = start - g0 * group, stop - g0 * group
    return fused if (lo, hi) == (0, fused.shape[0]) else fused[lo:hi].clone()


def _import(
    src: SliceSource, slot: _Slot, model: _Model, lay: _Layout, tp_rank: int, etp_rank: int
) -> torch.Tensor:
    rule = slot.rule
    rank, size = (etp_rank, lay.etp) if rule.expert else (tp_rank, lay.tp)
    if rule.transform in ("qkv", "gated_qkv"):
        return _import_qkv(src, slot, model, rank, size)
    if rule.transform in ("gdn_in_proj", "gdn_conv"):
        sections = []
        for name, rows in zip(slot.hf, model.sections(rule), strict=True):
            _length(src, name, 0, sum(rows))
            offset = 0
            for n in rows:
                start, stop = _span(name, n, rank, size)
                sections.append(src.get_rows(name, 0, offset + start, offset + stop))
                offset += n
        return torch.cat(sections)
    if rule.transform == "gate_up":
        gate, up = slot.hf
        n = _length(src, gate, 0)
        start, stop = _span(gate, n, rank, size)
        gate_rows = src.get_rows(gate, 0, start, stop)
        _length(src, up, 0, n)
        return fuse_gate_up(gate_rows, src.get_rows(up, 0, start, stop))
    (name,) = slot.hf
    if rule.transform == "vocab":
        vocab = _length(src, name, 0, model.vocab)
        padded = padded_vocab_size(vocab, lay.tp, lay.vocab_multiple)
        start, stop = _span(name, padded, rank, size)
        rows = src.get_rows(name, 0, min(start, vocab), min(stop, vocab))
        return pad_vocab(rows, stop - start)
    if rule.tp_dim is None:
        _shape(src, name)
        return src.get(name)
    n = _length(src, name, rule.tp_dim)
    start, stop = _span(name, n, rank, size)
    return src.get_rows(name, rule.tp_dim, start, stop)


def hf_to_mcore(
    hf_state: HFState,
    hf_config: PretrainedConfig,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    ep_rank: int = 0,
    ep_size: int = 1,
    etp_rank: int | None = None,
    etp_size: int = 1,
    vocab_multiple: int = 128,
    head: str = "lm",
) -> dict[str, torch.Tensor]:
    """This rank's local megatron-core tensors, named as in its GPTModel's ``state_dict``.

    `hf_state` maps HF checkpoint names to tensors: a mapping, a getter ``name -> tensor``
    (called once per tensor read) or a `SliceSource` such as `SafetensorsReader`, from which
    only this rank's slices are read. `etp_size` is the expert tensor-parallel size (as
    `twinkle_fn.mesh.Mesh.etp`, default 1; megatron-core's own default is `tp_size`) and
    `etp_rank` this rank's coordinate on it, by default ``tp_rank % etp_size``. The
    vocabulary is zero-padded to a multiple of ``vocab_multiple * tp_size`` (Megatron-LM's
    ``make_vocab_size_divisible_by``). `head` ``"value"`` reads a critic (`rules_for`): the
    value head's ``score`` tensors instead of the output layer's. Tensors keep the source
    dtype and may share memory with it. Raises ``ValueError`` for an unknown family, sizes that do not split the model (naming
    the config field), ranks out of range, and a missing or misshapen HF tensor (naming it);
    ``TypeError`` for an unusable `hf_state`.
    """
    return dict(
        iter_hf_to_mcore(
            hf_state,
            hf_config,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            pp_size=pp_size,
            ep_rank=ep_rank,
            ep_size=ep_size,
            etp_rank=etp_rank,
            etp_size=etp_size,
            vocab_multiple=vocab_multiple,
            head=head,
        )
    )


def iter_hf_to_mcore(
    hf_state: HFState,
    hf_config: PretrainedConfig,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    ep_rank: int = 0,
    ep_size: int = 1,
    etp_rank: int | None = None,
    etp_size: int = 1,
    vocab_multiple: int = 128,
    head: str = "lm",
) -> Iterator[tuple[str, torch.Tensor]]:
    """`hf_to_mcore`'s ``(megatron name, tensor)`` pairs one at a time, each read when it is
    asked for, so that a loader holds one converted tensor at a time. The arguments are checked
    before it returns (raising as `hf_to_mcore` does); a missing or misshapen HF tensor raises
    when it is reached."""
    rules, model, lay = _layout(
        hf_config, tp_size, pp_size, ep_size, etp_size, vocab_multiple, head
    )
    _rank("tp_rank", tp_rank, tp_size)
    _rank("pp_rank", pp_rank, pp_size)
    _rank("ep_rank", ep_rank, ep_size)
    etp = _etp_rank(tp_rank, etp_rank, lay)
    src = _source(hf_state)
    slots = _slots(rules, model, lay, pp_rank, (ep_rank,))
    return ((slot.mcore, _import(src, slot, model, lay, tp_rank, etp)) for slot in slots)
