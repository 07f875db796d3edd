"""The model and parallel layout the bridge tables are laid out over, and the expansion of a table
into the concrete tensors of one pipeline stage and expert-parallel rank.

`_layout` reads a family's table (`twinkle_fn.backends.megatron.bridge_rules.rules_for`) and the
sizes the bridge needs from an HF config (`_Model`), and checks them against the tp / pp / ep /
etp sizes (`_Layout`): a ``ValueError`` naming the size and the config field it must divide,
before any tensor moves. `_slots` yields each tensor of a stage with its HF and megatron-core
names. The functions that move tensors (`hf_to_mcore`, `mcore_to_hf`) live in
`twinkle_fn.backends.megatron.bridge`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from transformers import PretrainedConfig

from twinkle_fn.backends.megatron.bridge_rules import (
    Rule,
    linear_layers,
    megatron_family,
    mla_split_rows,
    moe_layers,
    rules_for,
)


@dataclass(frozen=True)
class _Model:
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int
    ffn: int
    moe_ffn: int
    shared_ffn: int
    experts: int
    moe: tuple[bool, ...]
    gated: bool = False
    linear: tuple[bool, ...] = ()
    # a DeltaNet's q (= k) rows, v rows, value heads, key heads
    gdn: tuple[int, int, int, int] = (0, 0, 0, 0)

    def sections(self, rule: Rule) -> tuple[tuple[int, ...], ...]:
        """Per HF tensor of a 'gdn_in_proj' / 'gdn_conv' rule, the row counts of its sections."""
        qk, v, heads, _ = self.gdn
        if rule.transform == "gdn_conv":
            return ((qk, qk, v),)
        return ((qk, qk, v), (v,), (heads,), (heads,))

    # rows of other tp-split tensors, by the config field(s) that size them
    split_rows: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class _Layout:
    tp: int
    pp: int
    ep: int
    etp: int
    vocab_multiple: int


def _model(hf_config: PretrainedConfig) -> _Model:
    heads = hf_config.num_attention_heads
    fam = megatron_family(hf_config)
    # multi-latent attention expands its keys and values to every head
    kv_heads = None if fam.latent_attention else getattr(hf_config, "num_key_value_heads", None)
    kv_heads = kv_heads or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    moe = moe_layers(hf_config)
    layout = fam.moe
    linear = linear_layers(hf_config)
    gdn = (0, 0, 0, 0)
    if any(linear):
        c = hf_config
        gdn = (
            c.linear_num_key_heads * c.linear_key_head_dim,
            c.linear_num_value_heads * c.linear_value_head_dim,
            c.linear_num_value_heads,
            c.linear_num_key_heads,
        )
    return _Model(
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=hf_config.vocab_size,
        layers=hf_config.num_hidden_layers,
        ffn=hf_config.intermediate_size,
        moe_ffn=getattr(hf_config, layout.ffn) if any(moe) else 0,
        shared_ffn=layout.shared.size(hf_config) if any(moe) and layout.shared else 0,
        experts=getattr(hf_config, layout.num_experts) if any(moe) else 0,
        moe=moe,
        gated=fam.attention_gate,
        linear=linear,
        gdn=gdn,
        split_rows=mla_split_rows(hf_config) if fam.latent_attention else (),
    )


def _positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _rank(name: str, rank: int, size: int) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < size:
        raise ValueError(f"{name}={rank!r} is out of range; use 0 <= {name} < {size}")


def _check_layout(model: _Model, lay: _Layout) -> None:
    _positive(
        tp_size=lay.tp,
        pp_size=lay.pp,
        ep_size=lay.ep,
        etp_size=lay.etp,
        vocab_multiple=lay.vocab_multiple,
    )
    heads, kv, tp = model.heads, model.kv_heads, lay.tp
    if heads % kv:
        raise ValueError(
            f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}"
        )
    if kv >= tp and kv % tp:
        raise ValueError(
            f"tp_size={tp} does not divide num_key_value_heads={kv}; megatron-core splits whole "
            "query groups over tensor parallelism. Use a tp_size that divides it."
        )
    key_heads, value_heads = model.gdn[3], model.gdn[2]
    if any(model.linear) and (key_heads % tp or value_heads % tp):
        raise ValueError(
            f"tp_size={tp} does not divide the Gated DeltaNet's linear_num_key_heads={key_heads} "
            f"and linear_num_value_heads={value_heads}; use a tp_size that divides both"
        )
    if model.gated and kv < tp:
        raise ValueError(
            f"tp_size={tp} exceeds num_key_value_heads={kv} of a gated attention (its q_proj "
            "holds an output gate), whose replicated kv heads the bridge does not lay out; use "
            "a tp_size that divides num_key_value_heads"
        )
    if kv < tp and (tp % kv or heads % tp or (kv * (heads // kv + 2) * model.head_dim) % tp):
        raise ValueError(
            f"tp_size={tp} exceeds num_key_value_heads={kv}, so megatron-core replicates kv heads: "
            f"that needs num_key_value_heads to divide tp_size and tp_size to divide "
            f"num_attention_heads={heads} and the fused qkv rows. Use a smaller tp_size."
        )
    for field, rows in model.split_rows:
        if rows % tp:
            raise ValueError(
                f"tp_size={tp} does not divide {field}={rows}, the rows of a projection "
                "megatron-core splits over tensor parallelism; use a tp_size that does"
            )
    if not all(model.moe) and model.ffn % tp:
        raise ValueError(
            f"tp_size={tp} does not divide intermediate_size={model.ffn}; use a tp_size that does"
        )
    if any(model.moe):
        if model.experts % lay.ep:
            raise ValueError(
                f"ep_size={lay.ep} does not divide num_experts={model.experts}; use one that does"
            )
        if model.shared_ffn % tp:
            raise ValueError(
                f"tp_size={tp} does not divide the shared expert's {model.shared_ffn} channels; "
                "use a tp_size that does"
            )
        if model.moe_ffn % lay.etp:
            raise ValueError(
                f"etp_size={lay.etp} does not divide moe_intermediate_size={model.moe_ffn}"
            )
    if model.layers % lay.pp:
        raise ValueError(
            f"pp_size={lay.pp} does not divide num_hidden_layers={model.layers}; the bridge "
            "places an equal number of layers on each pipeline stage"
        )


@dataclass(frozen=True)
class _Slot:
    rule: Rule
    hf: tuple[str, ...]
    mcore: str
    pp_rank: int
    ep_rank: int


def _slots(
    rules: Sequence[Rule], model: _Model, lay: _Layout, pp_rank: int, ep_ranks: Iterable[int]
) -> Iterator[_Slot]:
    # The tensors of pipeline stage `pp_rank` (and of the expert-parallel ranks `ep_ranks`), in
    # HF order: embedding, then layer by layer, then the final norm and output layer.
    first, last = pp_rank == 0, pp_rank == lay.pp - 1
    per_stage, local_experts = model.layers // lay.pp, model.experts // lay.ep
    ep_ranks = tuple(ep_ranks)
    if first:
        for rule in rules:
            if rule.stage == "first":
                yield _Slot(rule, rule.hf, rule.mcore, pp_rank, 0)
    for local in range(per_stage):
        layer = pp_rank * per_stage + local
        kind = "moe" if model.moe[layer] else "dense"
        mixer = "linear" if model.linear and model.linear[layer] else "attention"
        for rule in rules:
            if rule.stage != "layer" or rule.layers not in ("all", kind):
                continue
            if rule.mixer not in ("all", mixer):
                continue
            if not rule.expert:
                hf = tuple(p.format(layer=layer) for p in rule.hf)
                yield _Slot(rule, hf, rule.mcore.format(layer=local), pp_rank, 0)
                continue
            for ep_rank in ep_ranks:
                for j in range(local_experts):
                    expert = ep_rank * local_experts + j
                    hf = tuple(p.format(layer=layer, expert=expert) for p in rule.hf)
                    yield _Slot(
                        rule, hf, rule.mcore.format(layer=local, expert=j), pp_rank, ep_rank
                    )
    if last:
        for rule in rules:
            if rule.stage == "last" and not (rule.tied and first):
                yield _Slot(rule, rule.hf, rule.mcore, pp_rank, 0)


def _layout(
    hf_config: PretrainedConfig,
    tp_size: int,
    pp_size: int,
    ep_size: int,
    etp_size: int,
    vocab_multiple: int,
    head: str = "lm",
) -> tuple[list[Rule], _Model, _Layout]:
    rules = rules_for(hf_config, head)
    model = _model(hf_config)
    lay = _Layout(tp_size, pp_size, ep_size, etp_size, vocab_multiple)
    _check_layout(model, lay)
    return rules, model, lay


def _etp_rank(tp_rank: int, etp_rank: int | None, lay: _Layout) -> int:
    # megatron-core orders dense ranks tp-first and expert ranks etp-first, so when etp divides
    # tp a rank's expert TP coordinate is its TP coordinate modulo etp.
    if etp_rank is not None:
        _rank("etp_rank", etp_rank, lay.etp)
        return etp_rank
    if lay.tp % lay.etp:
        raise ValueError(
            f"etp_size={lay.etp} does not divide tp_size={lay.tp}, so the expert tensor-parallel "
            "rank does not follow from tp_rank; pass it (Mesh.expert_coords(rank)['etp'])"
        )
    return tp_rank % lay.etp
