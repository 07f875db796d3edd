"""Upstream Twinkle's metric API: `Metric` subclasses that ``model.add_metric`` attaches.

A metric sees every training (``forward_backward`` / ``backward``) or evaluation
(``forward_only``) forward of its optimizer group: ``accumulate(inputs, outputs, **info)`` gets
the collated batch (``input_ids``, ``labels``, ... tensors), the call's `ModelOutput` (``loss``,
``num_tokens``, ``logps`` / ``logits`` where the call returns them) and ``step`` (the group's
micro-batches so far) and ``gradient_accumulation_steps``. ``calculate()`` returns its numbers
(merged into ``calculate_metric``'s dict) and resets them; `Metric.gather_results` joins every
data rank's partial results, as upstream's metrics gather over the data-parallel group.

Upstream's own metric classes (`NOT_PROVIDED`) read outputs this build does not return from a
training forward (full logits, GRPO's rollout statistics): ``add_metric`` refuses them by name
with the reason; the model's built-in metrics (loss, grad norm, lr, tokens) are upstream's
``LossMetric`` / ``TrainMetric``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from twinkle.device_mesh import DeviceMesh
from twinkle_fn.distributed import world_size

# upstream's metric class -> why this build does not provide it
NOT_PROVIDED: Mapping[str, str] = {
    "LossMetric": "the model's calculate_metric already reports the token-mean loss",
    "TrainMetric": "the model's calculate_metric already reports grad_norm, lr and step",
    "Accuracy": "it reads the full logits, which a training forward here does not return "
    "(the fused loss never materialises them)",
    "DPOMetric": "it reads the reference log-probs of the interleaved pairs, which the DPO "
    "loss consumes inside the fused loss",
    "GRPOMetric": "it reads rollout statistics (rewards, clip ratios) from the sampler",
    "GSPOMetric": "it reads rollout statistics (rewards, clip ratios) from the sampler",
    "CISPOMetric": "it reads rollout statistics (rewards, clip ratios) from the sampler",
    "CompletionRewardMetric": "it reads completions and rewards from the sampler",
    "EmbeddingMetric": "embedding training (InfoNCE) is not in this build",
}


class Metric:
    """A metric over an optimizer group's forwards (upstream's ``twinkle.metric.Metric``).

    Subclasses override `accumulate`, `calculate` and `reset`. `device_mesh` and
    `process_group` are set by ``add_metric``: the model's mesh and the group to gather over
    (None: every data rank of the mesh).
    """

    def __init__(
        self, device_mesh: DeviceMesh | None = None, process_group: Any = None, **kwargs: Any
    ) -> None:
        self.device_mesh = device_mesh
        self.process_group = process_group

    def accumulate(self, inputs: Mapping[str, Any], outputs: Mapping[str, Any], **kwargs: Any):
        """Take one forward's collated `inputs` and its `outputs` (see the module docstring)."""

    def calculate(self) -> dict[str, Any]:
        """The metric's numbers since the last call; resets them."""
        return {}

    def reset(self) -> None:
        """Forget what was accumulated."""

    def gather_results(self, local_results: list[Any]) -> list[Any]:
        """`local_results` of every data rank, concatenated in rank order (one rank: as they
        are). A collective on more than one rank: every rank calls it. Each data rank counts
        once (its tp / pp / cp peers hold the same results)."""
        if world_size() == 1:
            return list(local_results)
        if self.process_group is not None:
            gathered = [None] * dist.get_world_size(self.process_group)
            dist.all_gather_object(gathered, local_results, group=self.process_group)
            return [r for part in gathered for r in part]
        gathered = [None] * world_size()
        dist.all_gather_object(gathered, local_results)
        per_data_rank: dict[int, list[Any]] = {}
        for rank, part in enumerate(gathered):
            data_rank = (
                rank
                if self.device_mesh is None
                else (self.device_mesh.get_data_rank_from_global_rank(rank))
            )
            per_data_rank.setdefault(data_rank, part)
        return [r for data_rank in sorted(per_data_rank) for r in per_data_rank[data_rank]]


def make_metric(metric_cls: Any, device_mesh: DeviceMesh | None, kwargs: dict[str, Any]) -> Metric:
    """A `Metric` from `metric_cls`: an instance (used as is, `kwargs` refused) or a subclass
    (built with ``device_mesh=`` and `kwargs`).

    Raises ``ValueError`` for a name (upstream's metric classes are `NOT_PROVIDED`, with the
    reason), and ``TypeError`` for anything that is not a `Metric` or for `kwargs` next to an
    instance.
    """
    if isinstance(metric_cls, str):
        why = NOT_PROVIDED.get(metric_cls, "no metric has that name")
        raise ValueError(
            f"add_metric({metric_cls!r}): this build does not provide it: {why}; pass a "
            "twinkle.metric.Metric subclass (or instance) of your own"
        )
    if isinstance(metric_cls, Metric):
        if kwargs:
            raise TypeError(
                f"add_metric got a metric instance and arguments {sorted(kwargs)}; pass the "
                "class with its arguments, or the instance alone"
            )
        return metric_cls
    if isinstance(metric_cls, type) and issubclass(metric_cls, Metric):
        return metric_cls(device_mesh=device_mesh, **kwargs)
    raise TypeError(
        f"add_metric takes a twinkle.metric.Metric subclass, instance or name, got {metric_cls!r}"
    )
