"""megatron-core -> HF: whole HF tensors from every rank's local megatron-core state.

`mcore_to_hf` walks the family's table (`twinkle_fn.backends.megatron.bridge_rules`) over every
pipeline stage and expert-parallel rank (`twinkle_fn.backends.megatron.bridge_layout`), layer by
layer, and joins each megatron tensor's tensor-parallel shards back into its HF tensors
(`join_shards`: q/k/v and gate/up split, the vocabulary padding cut;
`twinkle_fn.backends.megatron.bridge_transforms`). `twinkle_fn.backends.buckets.buckets` groups
that stream into size-bounded lists for saving or for an inference engine.
`twinkle_fn.backends.megatron.bridge` describes the layout conventions.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch
from transformers import PretrainedConfig

from twinkle_fn.backends.megatron.bridge_layout import (
    _etp_rank,
    _Layout,
    _layout,
    _Model,
    _model,
    _rank,
    _Slot,
    _slots,
)
from twinkle_fn.backends.megatron.bridge_rules import TRANSFORMS, Rule
from twinkle_fn.backends.megatron.bridge_transforms import (
    interleave_query_gate,
    split_gate_up,
    split_qkv,
    split_sections,
    tp_unshard,
    unpad_vocab,
)

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
