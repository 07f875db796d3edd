"""The HF <-> megatron-core weight bridge, as data: one table of `Rule` rows per model family.

A rule names HF tensors (the on-disk checkpoint names that ``from_pretrained`` loads, e.g.
per-expert ``mlp.experts.{expert}.gate_proj.weight`` for Qwen3-MoE), the megatron-core tensor
they become (the names of megatron-core's GPT layer spec), the transform between them and the dim
that tensor parallelism splits. Two functions interpret the tables:

- `hf_to_mcore` builds one rank's local state, reading only that rank's slices when the source
  supports partial reads (`SliceSource`, e.g. `twinkle_fn.backends.megatron.safetensors_io.SafetensorsReader`);
- `mcore_to_hf` streams full HF tensors from every rank's local state, layer by layer, and
  `export_buckets` groups that stream into size-bounded lists for saving or for an inference
  engine.

Layout conventions (megatron-core's): decoder layers are numbered locally per pipeline stage,
stage ``s`` holding global layers ``[s * L / pp, (s + 1) * L / pp)``; the embedding lives on the
first stage, the final norm and output layer on the last. With tied embeddings megatron-core
keeps a copy of the embedding as ``output_layer.weight`` on the last stage when ``pp > 1``: it
is imported there and never exported. Experts are numbered locally per expert-parallel rank
(global expert ``= ep_rank * E / ep + j``) and split within an expert over the expert-tensor-
parallel size ``etp`` (twinkle's `Mesh` default is 1; megatron-core's own default is the TP size).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch
from transformers import PretrainedConfig

from twinkle_fn.backends.megatron.bridge_layout import (
    _etp_rank,
    _Layout,
    _layout,
    _Model,
    _model,
    _positive,
    _rank,
    _Slot,
    _slots,
)
from twinkle_fn.backends.megatron.bridge_rules import (
    EMBEDDING,
    FINAL_NORM,
    INPUT_NORM,
    LAYER_KINDS,
    LM_HEAD,
    MLP,
    MLP_BIAS,
    O_BIAS,
    O_PROJ,
    POST_ATTN_NORM,
    QK_NORM,
    QKV,
    QKV_BIAS,
    STAGES,
    TIED_LM_HEAD,
    TRANSFORMS,
    VALUE_BIAS,
    VALUE_HEAD,
    Rule,
    moe_layers,
    moe_rules,
    rules_for,
)
from twinkle_fn.backends.megatron.bridge_transforms import (
    even_range,
    fuse_gate_up,
    fuse_qkv,
    group_query_gate,
    interleave_query_gate,
    pad_vocab,
    padded_vocab_size,
    split_gate_up,
    split_qkv,
    split_sections,
    tp_unshard,
    unpad_vocab,
)

__all__ = [
    "EMBEDDING",
    "FINAL_NORM",
    "INPUT_NORM",
    "LAYER_KINDS",
    "LM_HEAD",
    "MLP",
    "MLP_BIAS",
    "O_BIAS",
    "O_PROJ",
    "POST_ATTN_NORM",
    "QKV",
    "QKV_BIAS",
    "QK_NORM",
    "STAGES",
    "TIED_LM_HEAD",
    "TRANSFORMS",
    "VALUE_BIAS",
    "VALUE_HEAD",
    "HFState",
    "LocalStates",
    "Rule",
    "SliceSource",
    "export_buckets",
    "hf_to_mcore",
    "iter_hf_to_mcore",
    "join_shards",
    "mcore_to_hf",
    "moe_layers",
    "moe_rules",
    "rules_for",
]


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


LocalStates = Mapping[tuple[int, ...], Mapping[str, torch.Tensor]]


class _Ranks:
    """Finds, for a tensor, the local state of each TP (or expert TP) rank that holds it."""

    def __init__(self, states: LocalStates, lay: _Layout) -> None:
        self._dense: dict[tuple[int, ...], Mapping[str, torch.Tensor]] = {}
        self._expert: dict[tuple[int, ...], Mapping[str, torch.Tensor]] = {}
        for key in sorted(states):
            if not (isinstance(key, tuple) and len(key) in (3, 4)):
                raise ValueError(
                    f"local_states key {key!r} is not (tp_rank, pp_rank, ep_rank[, etp_rank])"
                )
            tp, pp, ep = key[:3]
            _rank("tp_rank", tp, lay.tp)
            _rank("pp_rank", pp, lay.pp)
            _rank("ep_rank", ep, lay.ep)
            etp = _etp_rank(tp, key[3] if len(key) == 4 else None, lay)
            # Non-expert tensors are replicas across ep; any rank of a (tp, pp) pair will do.
            self._dense.setdefault((tp, pp), states[key])
            self._expert.setdefault((etp, pp, ep), states[key])
        self._lay = lay

    def shards(self, slot: _Slot) -> list[torch.Tensor]:
        rule, lay = slot.rule, self._lay
        size = 1 if rule.tp_dim is None else lay.etp if rule.expert else lay.tp
        out = []
        for rank in range(size):
            key = (rank, slot.pp_rank, slot.ep_rank) if rule.expert else (rank, slot.pp_rank)
            state = (self._expert if rule.expert else self._dense).get(key)
            axes = "etp_rank, pp_rank, ep_rank" if rule.expert else "tp_rank, pp_rank"
            if state is None:
                raise ValueError(
                    f"local_states has no rank with ({axes}) = {key} for {slot.mcore!r}; pass "
                    "every rank's local state keyed by (tp_rank, pp_rank, ep_rank[, etp_rank])"
                )
            if slot.mcore not in state:
                raise ValueError(
                    f"megatron tensor {slot.mcore!r} is missing on rank ({axes}) = {key}"
                )
            out.append(state[slot.mcore].detach())
        return out


def join_shards(
    rule: Rule, hf_names: Sequence[str], shards: Sequence[torch.Tensor], hf_config: PretrainedConfig
) -> list[tuple[str, torch.Tensor]]:
    """The whole HF tensors of one megatron tensor of `rule`, from its tensor-parallel shards.

    `shards` are every TP (expert TP for expert rules) rank's local tensor in rank order (one
    for a replicated rule); `hf_names` name the results, one per HF tensor of the rule (q, k, v
    for 'qkv'; gate, up for 'gate_up'). The rule's transform and split dim apply to any tensor
    laid out like its megatron tensor (e.g. a LoRA factor split like its base weight). Raises
    ``ValueError`` for a wrong number of names, an unknown family, or shards that do not join.
    """
    if len(hf_names) != TRANSFORMS[rule.transform]:
        raise ValueError(
            f"rule {rule.transform!r} for {rule.mcore!r} takes {TRANSFORMS[rule.transform]} HF "
            f"names, got {len(hf_names)}"
        )
    return _join(rule, tuple(hf_names), list(shards), _model(hf_config))


def _join(
    rule: Rule, hf: tuple[str, ...], shards: list[torch.Tensor], model: _Model
) -> list[tuple[str, torch.Tensor]]:
    if rule.transform == "qkv":
        parts = split_qkv(tp_unshard(shards, 0), model.heads, model.kv_heads, model.head_dim)
        return list(zip(hf, parts, strict=True))
    if rule.transform == "gated_qkv":
        hd, per = model.head_dim, model.heads // model.kv_heads
        q, k, v = split_qkv(tp_unshard(shards, 0), 2 * model.heads, model.kv_heads, hd)
        return list(zip(hf, (interleave_query_gate(q, per, hd), k, v), strict=True))
    if rule.transform in ("gdn_in_proj", "gdn_conv"):
        rows = model.sections(rule)
        whole = iter(split_sections(shards, [n for per_name in rows for n in per_name]))
        return [
            (name, torch.cat([next(whole) for _ in per_name]))
            for name, per_name in zip(hf, rows, strict=True)
        ]
    if rule.transform == "gate_up":
        gates, ups = zip(*(split_gate_up(s) for s in shards), strict=True)
        return list(zip(hf, (tp_unshard(gates, 0), tp_unshard(ups, 0)), strict=True))
    (name,) = hf
    if rule.transform == "vocab":
        return [(name, unpad_vocab(tp_unshard(shards, 0), model.vocab))]
    return [(name, shards[0] if rule.tp_dim is None else tp_unshard(shards, rule.tp_dim))]


def _export(slot: _Slot, ranks: _Ranks, model: _Model) -> list[tuple[str, torch.Tensor]]:
    return _join(slot.rule, slot.hf, ranks.shards(slot), model)


def _export_stream(
    rules: Sequence[Rule], model: _Model, lay: _Layout, ranks: _Ranks
) -> Iterator[tuple[str, torch.Tensor]]:
    for pp_rank in range(lay.pp):
        for slot in _slots(rules, model, lay, pp_rank, range(lay.ep)):
            if not slot.rule.tied:
                yield from _export(slot, ranks, model)


def mcore_to_hf(
    local_states: LocalStates,
    hf_config: PretrainedConfig,
    *,
    tp_size: int,
    pp_size: int,
    ep_size: int = 1,
    etp_size: int = 1,
    vocab_multiple: int = 128,
    head: str = "lm",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF tensors ``(checkpoint_name, tensor)`` from every rank's local megatron state.

    `local_states` maps ``(tp_rank, pp_rank, ep_rank)`` -- with ``etp_rank`` appended when
    `etp_size` does not divide `tp_size` -- to that rank's local tensors (extra names such as
    ``_extra_state`` are ignored; ranks that only replicate another are optional). The stream goes layer by layer in HF order, so at most one layer's tensors are
    gathered at a time; tensors may share memory with the inputs. A tied embedding's output
    copy is not emitted. Layout arguments and `head` are as in `hf_to_mcore`. Raises ``ValueError``
    (eagerly) for an unknown family, a layout that does not split the model or bad keys, and
    (while streaming) for a rank or tensor missing from `local_states`.
    """
    rules, model, lay = _layout(
        hf_config, tp_size, pp_size, ep_size, etp_size, vocab_multiple, head
    )
    return _export_stream(rules, model, lay, _Ranks(local_states, lay))


def export_buckets(
    named: Iterable[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of `named` of at most `max_bytes` each (a larger tensor goes alone).

    Lazy: a bucket is yielded as soon as the next tensor would overflow it. Raises
    ``ValueError`` if `max_bytes` < 1.
    """
    _positive(max_bytes=max_bytes)
    return _buckets(named, max_bytes)


def _buckets(
    named: Iterable[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
