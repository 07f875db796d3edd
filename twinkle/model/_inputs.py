"""Inputs and outputs of the model classes' forward calls.

Features, chat trajectories (encoded by the group's `Template`) or a collated batch become the
core's batch through the group's `InputProcessor`; the no-grad forward's log-probs become a
`ModelOutput`. Also builds the template and processor that ``set_template`` /
``set_processor`` name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

import twinkle_fn as tf
from twinkle.data_format import ModelOutput
from twinkle.dataset import make_template
from twinkle.device_mesh import DeviceMesh
from twinkle.model._accumulate import read_loss
from twinkle.model._group import Group
from twinkle.model._loss_inputs import with_loss_inputs
from twinkle.processor import InputProcessor, unpack
from twinkle.template import Template
from twinkle_fn.data import IGNORE_INDEX
from twinkle_fn.moe import ROUTED_EXPERTS

Batch = dict[str, torch.Tensor]  # the core's batch: input_ids, labels, ... [batch, seq]


def template(g: Group, tokenizer_id: str | None) -> Template:
    """The group's template, built from `tokenizer_id` on first use. Raises ``ValueError``
    when there is none and no tokenizer to build one from."""
    if g.template is None:
        if tokenizer_id is None:
            raise ValueError(
                "chat trajectories need a template; call set_template('Template', "
                "model_id=<tokenizer dir>) (this model was built from a config)"
            )
        g.template = Template(tokenizer_id)
    return g.template


def tokenizer(g: Group, tokenizer_id: str | None) -> Any:
    """The group's tokenizer to save with a checkpoint, or None when it has none."""
    if g.template is None and tokenizer_id is not None:
        try:
            template(g, tokenizer_id)
        except ValueError:
            return None
    return None if g.template is None else g.template.tokenizer


def encode(
    g: Group,
    tokenizer_id: str | None,
    inputs: Any,
    loss_inputs: Mapping[str, Any] | None = None,
    mesh: DeviceMesh | None = None,
) -> Batch:
    """`inputs` (features, trajectories, or a collated batch) as the core's batch
    (``input_ids``/``labels``/... ``[batch, seq]``, or packed ``[1, total]``). For a training
    call (`loss_inputs` not None, possibly empty) it carries what the group's loss reads
    (`prepare`); otherwise nothing is attached or checked.

    Raises as `prepare` does.
    """
    return g.processor(prepare(g, tokenizer_id, inputs, loss_inputs, mesh))


def prepare(
    g: Group,
    tokenizer_id: str | None,
    inputs: Any,
    loss_inputs: Mapping[str, Any] | None,
    mesh: DeviceMesh | None = None,
) -> list[dict[str, Any]] | Mapping[str, Any]:
    """`inputs` as features (trajectories encoded by the group's template; one feature as a
    list of it) or a collated batch; for a training call (`loss_inputs` not None) with the
    per-sample data `loss_inputs` (``advantages``, ``old_logps``...) and the sequence weights
    of the group's loss attached (`twinkle.model._loss_inputs.with_loss_inputs`; the weights
    over every data rank of `mesh`, a collective on several ranks).

    Raises ``TypeError`` for inputs that are not a list or a mapping, ``ValueError`` when no
    sample is left, and as `with_loss_inputs` for loss inputs that the loss does not read,
    lacks or cannot align.
    """
    if isinstance(inputs, Mapping):
        ids = inputs.get("input_ids")
        if isinstance(ids, torch.Tensor) and ids.dim() == 2:
            return _attach(g, inputs, loss_inputs, mesh)  # a collated batch
        inputs = [inputs]
    if not isinstance(inputs, Sequence) or isinstance(inputs, str):
        raise TypeError(
            "inputs must be a list of features / trajectories or a collated batch, got "
            f"{type(inputs).__name__}"
        )
    if inputs and isinstance(inputs[0], Mapping) and "input_ids" not in inputs[0]:
        inputs = template(g, tokenizer_id).batch_encode(inputs)
    if not inputs:
        raise ValueError(
            "inputs is empty (or the template deleted every sample); each rank needs at "
            "least one sample per call"
        )
    return _attach(g, inputs, loss_inputs, mesh)


def _attach(
    g: Group, inputs: Any, loss_inputs: Mapping[str, Any] | None, mesh: DeviceMesh | None
) -> Any:
    """`with_loss_inputs` of the group's loss for a training call, else `inputs` as they are."""
    if loss_inputs is None:
        return inputs
    return with_loss_inputs(g.loss, inputs, loss_inputs, mesh)


def chunks(inputs: Any, micro_batch_size: int | None) -> list[Any]:
    """`inputs` whole, or as lists of `micro_batch_size` samples. Raises ``ValueError`` for a
    `micro_batch_size` that is not a positive int, ``TypeError`` for one with a collated
    batch."""
    if micro_batch_size is None:
        return [inputs]
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int):
        raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    if isinstance(inputs, Mapping) or not isinstance(inputs, Sequence):
        raise TypeError("micro_batch_size needs inputs as a list of features / trajectories")
    return [inputs[i : i + micro_batch_size] for i in range(0, len(inputs), micro_batch_size)]


def outputs(
    state: tf.TrainState,
    batch: Batch,
    temperature: float,
    return_logits: bool,
    disable_lora: bool = False,
    record_routing: bool = False,
) -> ModelOutput:
    """The no-grad forward's ``logps`` ([n_seq, max_len]), ``loss``, ``num_tokens`` and,
    when asked, ``logits`` and an MoE model's ``routed_experts`` ([n_seq, max_len,
    moe_layers, top_k], `twinkle_fn.moe`)."""
    got = tf.token_logps(
        state,
        batch,
        temperature=temperature,
        return_logits=return_logits,
        disable_lora=disable_lora,
        record_routing=record_routing,
    )
    logps, logits = got["logps"], got.get("logits")
    num_tokens = (batch["labels"] != IGNORE_INDEX).sum()
    out = ModelOutput(logps=unpack(logps, batch), **read_loss(-logps.sum(), num_tokens))
    if logits is not None:
        out["logits"] = logits
    if record_routing:
        out[ROUTED_EXPERTS] = unpack(got[ROUTED_EXPERTS], batch)
    return out


REPLAY_ACTIONS = ("record", "replay_forward")


def replay_action(action: Any) -> str | None:
    """Upstream's ``router_replay_action`` (its ``RouterReplayAction`` enum, or the value's
    string) as ``"record"`` / ``"replay_forward"``, or None. Raises ``ValueError`` for
    another action."""
    if action is None:
        return None
    value = getattr(action, "value", action)
    if value not in REPLAY_ACTIONS:
        raise ValueError(
            f"router_replay_action must be one of {REPLAY_ACTIONS} (or upstream's "
            f"RouterReplayAction.RECORD / REPLAY_FORWARD), got {action!r}"
        )
    return value


def split_routing(inputs: Any) -> tuple[Any, list[torch.Tensor] | None]:
    """`inputs` without their samples' ``routed_experts`` (each ``[len, moe_layers,
    top_k]``, upstream's per-sample replay record) and those records, or None when the samples
    carry none (a collated batch keeps its own: the core reads it)."""
    if isinstance(inputs, Mapping) and not isinstance(inputs.get("input_ids"), torch.Tensor):
        inputs = [inputs]
    if not isinstance(inputs, Sequence) or not inputs or not isinstance(inputs[0], Mapping):
        return inputs, None
    if ROUTED_EXPERTS not in inputs[0]:
        return inputs, None
    records = [torch.as_tensor(f[ROUTED_EXPERTS]) for f in inputs]
    return [{k: v for k, v in f.items() if k != ROUTED_EXPERTS} for f in inputs], records


def with_routing(batch: Batch, records: list[torch.Tensor] | None) -> Batch:
    """`batch` carrying the samples' replay `records` as the core's ``routed_experts``
    (``[B, T, L, k]`` padded, ``[1, T, L, k]`` packed; rows of `batch` in the samples'
    order). Raises ``ValueError`` when the records do not match the batch's samples."""
    if records is None:
        return batch
    packed = "cu_seqlens" in batch
    lengths = (
        [int(b - a) for a, b in zip(batch["cu_seqlens"][:-1], batch["cu_seqlens"][1:], strict=True)]
        if packed
        else batch.get("attention_mask", torch.ones_like(batch["input_ids"])).sum(1).tolist()
    )
    got = [len(r) for r in records]
    if len(got) != len(lengths) or any(g < n for g, n in zip(got, lengths, strict=False)):
        raise ValueError(
            f"the samples' routed_experts cover {got} tokens, the batch's samples {lengths}; "
            "pass each sample's record of its tokens (a row of forward_only's routed_experts)"
        )
    # a row of forward_only's [n_seq, max_len, L, k] runs past its sample: padding
    records = [r[:n] for r, n in zip(records, lengths, strict=True)]
    tail = records[0].shape[1:]
    if packed:
        record = torch.cat(records)[None].long()  # [1, T, L, k]
    else:
        record = torch.zeros(*batch["input_ids"].shape, *tail, dtype=torch.int64)
        for row, r in enumerate(records):
            record[row, : len(r)] = r
    return {**batch, ROUTED_EXPERTS: record}


def requested_outputs(
    state: tf.TrainState,
    batch: Batch,
    temperature: float,
    return_logps: bool,
    return_logits: bool,
) -> ModelOutput:
    """`outputs` holding only the requested ``logps`` / ``logits`` (with ``loss`` and
    ``num_tokens``), or an empty `ModelOutput` (no forward) when neither is requested."""
    if not (return_logps or return_logits):
        return ModelOutput()
    out = outputs(state, batch, temperature, return_logits)
    if not return_logps:
        del out["logps"]
    return out


def make_group_template(
    template_cls: Any, tokenizer_id: str | None, kwargs: dict[str, Any]
) -> Template:
    """A `Template` (an instance, or the class / 'Template' built with `kwargs`; ``model_id``
    defaults to `tokenizer_id`). Raises ``ValueError`` for anything else."""
    if not isinstance(template_cls, Template):
        kwargs.setdefault("model_id", tokenizer_id)
    return make_template(template_cls, **kwargs)


def make_processor(
    processor_cls: Any, device_mesh: DeviceMesh, kwargs: dict[str, Any]
) -> InputProcessor:
    """An `InputProcessor` (an instance, or the class / 'InputProcessor' built with `kwargs`;
    ``device_mesh`` defaults to `device_mesh`). Raises ``ValueError`` for anything else."""
    if isinstance(processor_cls, InputProcessor):
        return processor_cls
    if processor_cls in ("InputProcessor", InputProcessor):
        kwargs.setdefault("device_mesh", device_mesh)
        return InputProcessor(**kwargs)
    raise ValueError(f"unknown processor {processor_cls!r}; use 'InputProcessor'")


def take_routing(inputs: Any, action: Any, where: str) -> tuple[Any, list[torch.Tensor] | None]:
    """`inputs` without their samples' ``routed_experts``, and those records when `action`
    replays them (None otherwise). Raises ``ValueError`` for an unknown action, and for
    ``RECORD`` in `where` ``"forward_backward"`` (record in ``forward_only``)."""
    action = replay_action(action)
    if action == "record" and where == "forward_backward":
        raise ValueError(
            "router_replay_action RECORD belongs to forward_only (its routed_experts output); "
            "forward_backward replays them with REPLAY_FORWARD"
        )
    inputs, records = split_routing(inputs)
    return inputs, records if action == "replay_forward" else None
