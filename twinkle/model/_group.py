"""Upstream's optimizer groups: what the full model (group ``''``) or each LoRA adapter trains
with, how a group is looked up by adapter name, and the settings checks of the training calls
(accumulation steps, loss, a new adapter).

Both model classes keep their groups in `Groups`, each with its own train state and pending
gradients: `TransformersModel` one group per adapter (that adapter's weights, optimizer state
and step), `MegatronModel` one (the full model, or its one adapter). The group's optimizer and
scheduler become the core's transform through `optim`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

import twinkle_fn as tf
from twinkle.data_format import ModelOutput
from twinkle.device_mesh import DeviceMesh
from twinkle.loss import CrossEntropyLoss, Loss, make_loss
from twinkle.metric import Metric, make_metric
from twinkle.model import optim
from twinkle.model._accumulate import Pending
from twinkle.processor import InputProcessor
from twinkle.template import Template
from twinkle_fn.distributed import gather_tensors, world_size
from twinkle_fn.optim import GradientTransformation, Schedule


@dataclasses.dataclass
class Group:
    """Upstream's optimizer group: what one adapter (or ``''``, the full model) trains with."""

    name: str = ""
    gradient_accumulation_steps: int = 1
    optimizer: optim.OptimizerSpec = dataclasses.field(
        default_factory=lambda: optim.optimizer_spec("AdamW")
    )
    scheduler: tuple[Any, dict[str, Any]] | None = None
    loss: Loss = dataclasses.field(default_factory=CrossEntropyLoss)
    template: Template | None = None
    processor: InputProcessor | None = None
    last: tuple[dict[str, torch.Tensor], ModelOutput, bool] | None = None  # batch, out, train
    eval_sums: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.0])
    # The group's training: None until built (and while MegatronModel has it offloaded).
    state: tf.TrainState | None = None
    pending: Pending = dataclasses.field(default_factory=Pending)
    # add_metric's metrics: of training forwards (True) and of evaluation forwards (False)
    metrics: dict[bool, list[Metric]] = dataclasses.field(
        default_factory=lambda: {True: [], False: []}
    )


@dataclasses.dataclass(frozen=True)
class GroupView:
    """What upstream's scripts read of an optimizer group (``model.optimizer_group[name]``):
    its adapter name, `gradient_accumulation_steps` and `cur_step`, the micro-batches it has
    trained on (``forward_backward`` calls, stepped or not), as upstream counts them."""

    group: Group

    @property
    def adapter_name(self) -> str:
        return self.group.name

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.group.gradient_accumulation_steps

    @property
    def cur_step(self) -> int:
        return self.group.pending.seen


class Groups:
    """A model's groups by adapter name: the full-model group ``''`` until the first adapter is
    added, then one group per adapter (the ``''`` group keeps the settings made before, which
    every new adapter's group starts from). Without a name, a call uses the last added group,
    upstream's active group."""

    def __init__(self, default: Group) -> None:
        self._default = default
        self._adapters: dict[str, Group] = {}

    def __iter__(self) -> Iterator[Group]:
        """The training groups: the adapters' in the order added, else the ``''`` group."""
        return iter(self._adapters.values() or [self._default])

    @property
    def adapter_names(self) -> list[str]:
        """The adapters' names, in the order added."""
        return list(self._adapters)

    @property
    def built(self) -> bool:
        """Whether the train states exist (they are built together, on first use)."""
        return any(g.state is not None for g in self)

    def resolve(self, adapter_name: str | None) -> Group:
        """The group of adapter `adapter_name` (None: the last added, else ``''``).

        Raises ``ValueError`` for ``''`` once an adapter trains, and for an unknown name,
        listing the adapters there are.
        """
        if adapter_name is None:
            return next(reversed(self._adapters.values()), self._default)
        if adapter_name in self._adapters:
            return self._adapters[adapter_name]
        if not self._adapters:
            return resolve(self._default, adapter_name)
        names = self.adapter_names
        if adapter_name == "":
            raise ValueError(
                f"this model trains LoRA adapters {names}; the full-parameter group '' no "
                "longer trains once an adapter is added: pass adapter_name=one of them"
            )
        raise ValueError(
            f"adapter {adapter_name!r} does not exist; this model has adapters {names}. Add "
            "it with add_adapter_to_model(name, LoraConfig(...)) before training"
        )

    def add(self, adapter_name: Any, is_trainable: bool, gradient_accumulation_steps: int) -> Group:
        """A new group for adapter `adapter_name`, with the ``''`` group's settings and
        `gradient_accumulation_steps` (`register` it once the adapter is in the model; the
        model class refuses adapters once its states are built).

        Raises ``ValueError`` for an empty or taken name (listing the adapters there), for
        ``is_trainable=False`` and a bad `gradient_accumulation_steps`.
        """
        if not isinstance(adapter_name, str) or not adapter_name:
            raise ValueError(f"adapter_name must be a non-empty str, got {adapter_name!r}")
        if adapter_name in self._adapters:
            raise ValueError(
                f"adapter {adapter_name!r} already exists (adapters: {self.adapter_names}); "
                "add another adapter under a new name"
            )
        if not is_trainable:
            raise ValueError("is_trainable=False is not supported: an added adapter trains")
        gas = accumulation_steps(self._default, gradient_accumulation_steps)
        return dataclasses.replace(
            self._default,
            name=adapter_name,
            gradient_accumulation_steps=gas,
            last=None,
            eval_sums=[0.0, 0.0],
            state=None,
            pending=Pending(),
        )

    def register(self, g: Group) -> None:
        """Train group `g` (from `add`, once its adapter is in the model) from now on."""
        self._adapters[g.name] = g


def resolve(g: Group, adapter_name: str | None) -> Group:
    """`g` when `adapter_name` names it (None: `g`), for a model of one group.

    Raises ``ValueError`` for any other name.
    """
    if adapter_name is None or adapter_name == g.name:
        return g
    have = repr(g.name) if g.name else "no adapter (only the default group '')"
    raise ValueError(
        f"adapter {adapter_name!r} does not exist; this model has {have}. Add it with "
        "add_adapter_to_model(name, LoraConfig(...)) before training"
    )


def learning_rate(g: Group) -> float | Schedule:
    """The group's lr: its optimizer's, scheduled when a scheduler is set."""
    if g.scheduler is None:
        return g.optimizer.lr
    cls, kwargs = g.scheduler
    return optim.schedule(cls, g.optimizer.lr, **kwargs)


def transform(g: Group, max_grad_norm: float | None) -> GradientTransformation:
    """The group's optimizer transform, clipping to `max_grad_norm` unless it is None."""
    return optim.transform(g.optimizer, learning_rate(g), max_grad_norm)


def step(g: Group) -> None:
    """One update of the group's state by its optimizer from its pending gradients (then
    cleared), clipped to the norm chosen for this step; records ``g.pending.last_step``."""
    assert g.state is not None
    g.state = g.pending.apply(g.state.replace(tx=transform(g, g.pending.clip)))


def build_states(
    model: tf.models.Model, groups: Groups, mesh: tf.Mesh, seed: int | None
) -> tf.models.Model:
    """Build every group's train state on `mesh`: an adapter's over that adapter's weights
    alone (`twinkle_fn.backends.transformers.lora.set_adapter` first), the ``''`` group's over the trainable
    weights. The first shards the module; the others share it. Returns the placed model."""
    for g in groups:
        if g.name:
            tf.lora.set_adapter(model, g.name)
        g.state = tf.init(model, transform(g, None), mesh, seed=seed)
        model = g.state.model
    return model


def set_scheduler(g: Group, scheduler_cls: Any, kwargs: dict[str, Any]) -> None:
    """Schedule the group's lr with `scheduler_cls(**kwargs)`. Raises ``ValueError`` (before
    changing anything) for what `optim.schedule` rejects."""
    optim.schedule(scheduler_cls, g.optimizer.lr, **kwargs)
    g.scheduler = (scheduler_cls, kwargs)


def accumulation_steps(g: Group, gradient_accumulation_steps: int | None) -> int:
    """`gradient_accumulation_steps`, else (None) the group's. Raises ``ValueError`` unless it
    is a positive int (0 is refused, not read as "the default")."""
    gas = (
        g.gradient_accumulation_steps
        if gradient_accumulation_steps is None
        else (gradient_accumulation_steps)
    )
    if isinstance(gas, bool) or not isinstance(gas, int) or gas < 1:
        raise ValueError(
            f"gradient_accumulation_steps must be a positive int (micro-batches per optimizer "
            f"step), got {gas!r}; pass 1 to step after every forward_backward"
        )
    return gas


def model_loss(loss_cls: Any, kwargs: dict[str, Any]) -> Loss:
    """The `twinkle.loss` loss `loss_cls` names (`twinkle.loss.make_loss`) for a model to train
    with. Raises ``ValueError`` as `make_loss` does, and for an ``ignore_index`` other than
    -100 (the model's labels mark ignored tokens with -100)."""
    loss = make_loss(loss_cls, **kwargs)
    if loss.ignore_index != -100:
        raise ValueError(f"ignore_index must be -100, got {loss.ignore_index}")
    return loss


def add_metric(
    g: Group, metric_cls: Any, is_training: bool | None, kwargs: dict[str, Any], mesh: DeviceMesh
) -> None:
    """Attach a metric (`twinkle.metric.make_metric`) to `g`'s training forwards
    (`is_training` True), evaluation forwards (False) or both (None: two instances, as
    upstream builds one per list). Raises as `make_metric` does."""
    for training in (True, False):
        if is_training is None or is_training is training:
            g.metrics[training].append(make_metric(metric_cls, mesh, dict(kwargs)))


def accumulate_metrics(
    g: Group, inputs: Callable[[], dict[str, Any]], out: ModelOutput, training: bool
) -> None:
    """Hand one forward to `g`'s metrics of its kind: `inputs` gives the collated batch (built
    only when a metric is attached), `out` the call's outputs."""
    metrics = g.metrics[training]
    if not metrics:
        return
    batch = inputs()
    info = {"step": g.pending.seen, "gradient_accumulation_steps": g.gradient_accumulation_steps}
    for metric in metrics:
        metric.accumulate(batch, out, **info)


def calculate_metrics(g: Group, training: bool) -> dict[str, Any]:
    """The numbers of `g`'s metrics of that kind, merged in the order they were added (each
    resets). A collective where a metric gathers: every rank calls it."""
    merged: dict[str, Any] = {}
    for metric in g.metrics[training]:
        merged.update(metric.calculate() or {})
    return merged


def add_eval(g: Group, out: ModelOutput) -> None:
    """Count an evaluation forward's ``loss`` and ``num_tokens`` into the group's sums."""
    g.eval_sums[0] += out["loss"] * out["num_tokens"]
    g.eval_sums[1] += out["num_tokens"]


def pop_eval(g: Group, mesh: DeviceMesh) -> dict[str, float | int]:
    """The token-mean ``loss`` and ``num_tokens`` of the evaluation forwards since the last
    call, over every data rank of `mesh` (each rank reports the same numbers, as upstream's
    ``LossMetric`` gathers over the data-parallel group); resets the sums.

    A collective on more than one rank: every rank of the world must call it. Each data rank
    counts once (its tp/pp/cp peers hold the same sums)."""
    loss_sum, num_tokens = g.eval_sums
    g.eval_sums = [0.0, 0.0]
    if world_size() > 1:
        local = torch.tensor([loss_sum, num_tokens], dtype=torch.float64)
        gathered = gather_tensors({"sums": local})
        per_data_rank: dict[int, torch.Tensor] = {}
        for rank in sorted(gathered):
            data_rank = mesh.get_data_rank_from_global_rank(rank)
            per_data_rank.setdefault(data_rank, gathered[rank]["sums"])
        loss_sum, num_tokens = (float(x) for x in sum(per_data_rank.values()))
    return {"loss": loss_sum / max(num_tokens, 1.0), "num_tokens": int(num_tokens)}


def last_loss(g: Group) -> float:
    """The loss of the group's last forward. Raises ``ValueError`` before any forward."""
    if g.last is None:
        raise ValueError("calculate_loss needs a forward/forward_only call first")
    return g.last[1]["loss"]


def describe(g: Group) -> list[str]:
    """Readable lines on how the group trains (adapter, optimizer, schedule, loss...)."""
    opt = g.optimizer
    sched = "constant lr" if g.scheduler is None else f"{g.scheduler[0]}({g.scheduler[1]})"
    processor = g.processor
    return [
        f"adapter: {g.name or 'none (full parameters)'}",
        f"optimizer: {opt.name}(lr={opt.lr}, {opt.kwargs})",
        f"lr_scheduler: {sched}",
        f"gradient_accumulation_steps: {g.gradient_accumulation_steps}",
        f"loss: {g.loss!r} (token sums normalised once over every micro-batch and data rank)",
        f"processor: padding_free={processor.padding_free if processor else False}",
    ]
