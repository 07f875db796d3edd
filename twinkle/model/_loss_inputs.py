"""A training call's per-sample loss data (``advantages``, ``old_logps``, ``ref_logps``...) as
batch fields: the numbers the group's loss reads, aligned with each sample's tokens.

``forward_backward(inputs=..., advantages=..., old_logps=...)`` gives them per sample, in any of
upstream's forms (`twinkle.loss.base.align_rows`); here each becomes a per-token list on its
feature (or a ``[B, T]`` tensor on a collated batch), so the core's collation, packing, micro-
batch and data-rank splits carry it with its tokens. The loss's sequence weights
(``loss_weights``, `twinkle.loss.base.Loss.row_weights`) are taken over the call's samples on
every data rank.
Everything is checked before any compute.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from twinkle.device_mesh import DeviceMesh
from twinkle.loss import Loss
from twinkle.loss.base import align_rows
from twinkle_fn.data import IGNORE_INDEX
from twinkle_fn.distributed import gather_tensors, world_size

# What to pass for each input a loss needs, for the error that says it is missing.
_FIX = {
    "advantages": "pass advantages=<one number per sample> (e.g. twinkle.advantage."
    "GRPOAdvantage()(rewards, num_generations))",
    "old_logps": "pass old_logps=<the sampler's per-token log-probs of each sample's response>, "
    "or the logps of forward_only(inputs=...) taken before the update",
    "ref_logps": "pass ref_logps=<the reference's per-token log-probs>, e.g. "
    "forward_only(inputs=..., disable_lora=True)['logps'] of a LoRA model, or set beta=0",
    "rollout_logps": "pass rollout_logps=<the sampler's per-token log-probs>, or tis_cap=None",
    "returns": "pass returns=<per-token returns, e.g. GAE advantages + old_values>",
    "old_values": "pass old_values=<the critic's forward_only(inputs=...)['values'] taken "
    "before the update>, or set_loss('PPOValueLoss', clip=None)",
}


def with_loss_inputs(
    loss: Loss, inputs: Any, given: Mapping[str, Any], mesh: DeviceMesh | None = None
) -> Any:
    """`inputs` (a list of features, or a collated padded batch ``[B, T]``) with `given`
    (name -> per-sample data; None values are absent) and the loss's ``loss_weights`` attached
    as batch fields. Features are copied, not modified.

    The weights are the loss's over this call's samples on every data rank of `mesh` (so a
    sequence mean is the mean over all of them, as one process would take it): on several
    ranks a collective, which every rank's call joins (the training call already is one).

    `given` passes through the loss's ``model_data`` first (e.g. DPO's ``ref_outputs``).
    Raises ``TypeError`` for a name `loss` does not read; ``ValueError`` naming the loss, the
    input and the fix when one it needs is neither given nor on every feature, when data do
    not align with the samples (`align_rows`), and for per-sample data with a packed batch.
    """
    given = {k: v for k, v in given.items() if v is not None}
    unknown = sorted(set(given) - set(loss.model_inputs))
    if unknown:
        reads = list(loss.model_inputs) or "no per-sample data"
        raise TypeError(
            f"forward_backward got {unknown}, which the loss {loss!r} does not read (it reads "
            f"{reads}); set the loss that reads them first, e.g. set_loss('GRPOLoss')"
        )
    if loss.token_loss() is None:
        return inputs
    given = loss.model_data(given, len(inputs["labels"] if isinstance(inputs, Mapping) else inputs))
    if isinstance(inputs, Mapping):
        return _batch_fields(loss, inputs, given, mesh)
    return _feature_fields(loss, inputs, given, mesh)


def _feature_fields(
    loss: Loss,
    features: Sequence[Mapping[str, Any]],
    given: Mapping[str, Any],
    mesh: DeviceMesh | None,
) -> list[dict[str, Any]]:
    """`features` as new dicts carrying the loss's fields (per-token float32 tensors)."""
    out = [dict(f) for f in features]
    _check_present(loss, given, [set(f) for f in out])
    masks = [torch.as_tensor(f["labels"]) != IGNORE_INDEX for f in out]
    for name, value in given.items():
        for f, row in zip(out, align_rows(name, value, masks, torch.float32, loss), strict=True):
            f[name] = row
    if loss.weighs_rows and not all("loss_weights" in f for f in out):
        weights = _call_weights(loss, [int(m.sum()) for m in masks], mesh)
        for f, w in zip(out, weights, strict=True):
            f["loss_weights"] = w
    return out


def _batch_fields(
    loss: Loss, batch: Mapping[str, Any], given: Mapping[str, Any], mesh: DeviceMesh | None
) -> dict[str, Any]:
    """A collated padded `batch` with the loss's fields as ``[B, T]`` float32 tensors."""
    out = dict(batch)
    _check_present(loss, given, [set(out)])
    weighted = loss.weighs_rows and "loss_weights" not in out
    if "cu_seqlens" in out and (given or weighted):
        raise ValueError(
            f"the loss {loss!r} needs per-sample data, which a packed batch [1, total] cannot "
            "take; pass the features (a list of dicts) and set_processor(padding_free=True)"
        )
    masks = list(out["labels"] != IGNORE_INDEX)  # [T] per row
    for name, value in given.items():
        out[name] = torch.stack(align_rows(name, value, masks, torch.float32, loss))
    if weighted:
        weights = _call_weights(loss, [int(m.sum()) for m in masks], mesh)
        out["loss_weights"] = torch.tensor(weights, dtype=torch.float32)[:, None].expand(
            out["labels"].shape
        )
    return out


def _call_weights(loss: Loss, lengths: list[int], mesh: DeviceMesh | None) -> list[float]:
    """`loss`'s ``row_weights`` of this rank's samples (`lengths` supervised tokens each),
    taken over the samples of every data rank of `mesh` in data-rank order (a collective on
    several ranks; a data rank's tp / pp / cp peers hold the same samples and count once)."""
    if mesh is None or world_size() == 1:
        return loss.row_weights(lengths)
    gathered = gather_tensors({"lengths": torch.tensor(lengths, dtype=torch.int64)})
    per_data_rank: dict[int, list[int]] = {}
    for r in sorted(gathered):
        data_rank = mesh.get_data_rank_from_global_rank(r)
        per_data_rank.setdefault(data_rank, gathered[r]["lengths"].tolist())
    order = sorted(per_data_rank)
    weights = loss.row_weights([n for d in order for n in per_data_rank[d]])
    start = sum(len(per_data_rank[d]) for d in order if d < mesh.data_rank)
    return weights[start : start + len(lengths)]


def _check_present(loss: Loss, given: Mapping[str, Any], keys: Sequence[set[str]]) -> None:
    """Raises ``ValueError`` for an input `loss` needs that is neither in `given` nor in every
    one of `keys` (each feature's, or the batch's)."""
    for name in loss.required_inputs():
        if name not in given and not all(name in k for k in keys):
            raise ValueError(
                f"the loss {loss!r} needs {name}, which forward_backward did not get; "
                f"{_FIX.get(name, f'pass {name}=...')}"
            )
