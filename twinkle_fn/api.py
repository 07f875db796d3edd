"""The functional API: `init`, `shard`, `fwd_bwd`, `step`.

Each function is pure in meaning and in-place underneath (see `twinkle_fn.state`): `fwd_bwd`
never touches the state; `step` consumes the state and the grads (``donate=True``) or works on
copies (``donate=False``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, overload

import torch

from twinkle_fn import backends, lora
from twinkle_fn.batch_check import check_batch
from twinkle_fn.distributed import gather_tensors, rank, world_size
from twinkle_fn.losses import (
    LossOutput,
    SequenceLoss,
    TokenLoss,
    check_head,
    check_loss,
    is_sequence_loss,
)
from twinkle_fn.mesh import Mesh
from twinkle_fn.models import Model
from twinkle_fn.models.families import family
from twinkle_fn.optim import GradientTransformation
from twinkle_fn.pytree import tree_leaves
from twinkle_fn.state import Grads, TrainState, next_key
from twinkle_fn.step_guards import (
    ON_NONFINITE,
    NonFiniteError,
    check_grads,
    check_next_lr,
    nonfinite_guard,
)

__all__ = [
    "ON_NONFINITE",
    "NonFiniteError",
    "check_grads",
    "evaluate",
    "fwd_bwd",
    "grad_norm",
    "init",
    "shard",
    "step",
    "token_logps",
    "token_values",
    "unshard",
]


def init(
    model: Model,
    tx: GradientTransformation,
    mesh: Mesh | None = None,
    *,
    seed: int = 0,
    loss_scale: float = 2.0**10,
) -> TrainState:
    """A fresh train state: the model's trainable parameters, ``tx.init`` of them, step 0.

    Trainable means ``requires_grad`` (frozen base weights under LoRA stay out of the state and
    the optimizer). `mesh` defaults to one process (on several ranks: a whole, unsharded copy
    per rank); a larger mesh must match the world, and the model is first sharded over it, so
    the optimizer state is born sharded like its parameters. Every rank must call this with the
    same model weights. A transformers-backend model computing in float16 gets a dynamic loss
    scale starting at `loss_scale` (megatron's optimizer scales its own); the loss here is a
    token *sum*, so this starts lower than the 2**16 usual for mean losses. Raises ``ValueError``
    when the model has no trainable parameter or the mesh does not fit the world.
    """
    mesh = mesh or Mesh()
    backend = backends.get(model.backend)
    model = backend.prepare(model, mesh)
    params = backend.trainable(model)
    if not params:
        raise ValueError("the model has no trainable parameter (every requires_grad is False)")
    return TrainState(
        params=params,
        opt_state=tx.init(params),
        step=torch.zeros((), dtype=torch.int64),
        rng=torch.tensor(seed, dtype=torch.int64),
        model=model,
        tx=tx,
        mesh=mesh,
        loss_scale=backend.initial_loss_scale(model, loss_scale),
    )


@overload
def shard(state: TrainState, mesh: Mesh) -> TrainState: ...
@overload
def shard(
    state: Mapping[str, torch.Tensor], mesh: Mesh, model: Model
) -> dict[str, torch.Tensor]: ...
def shard(
    state: TrainState | Mapping[str, torch.Tensor], mesh: Mesh, model: Model | None = None
) -> TrainState | dict[str, torch.Tensor]:
    """`state` placed on `mesh`: parameters and optimizer state sharded by the family's plan.

    On one process, or when `state` already lives on `mesh`, `state` is returned as it is.
    Otherwise the state is donated: its module is sharded in place (TP plan, then FSDP2) and
    each optimizer-state tensor is split exactly like its parameter. Every rank must call it
    with the same full state. Raises ``ValueError`` when the mesh does not match the world, asks
    for axes this backend lacks, or does not divide the model.

    ``shard(params, mesh, model)`` on a bare mapping of whole tensors in HF names (a module's
    ``state_dict``, a checkpoint's tensors) returns this rank's pieces (rank 0 without a process
    group), cut by the specs or rules `model`'s backend places with and keyed as a state's
    ``params`` (megatron: megatron names); no communication. Raises ``TypeError`` without
    `model` (or with one for a state), ``ValueError`` as above or for a tensor the model lacks.
    """
    if not isinstance(state, TrainState):
        if model is None:
            raise TypeError("tf.shard(params, mesh, model) needs the model the params belong to")
        if world_size() > 1:
            mesh.validate(world_size())
        return backends.get(model.backend).shard_params(state, mesh, model, rank())
    if model is not None:
        raise TypeError("tf.shard(state, mesh) takes no model: the state carries its own")
    state.check_alive()
    if mesh.world_size == 1 or state.mesh == mesh:
        return state
    lora.use_adapter(state)  # the re-init below takes what requires grad: this state's adapter
    if state.model.placement is not None:
        raise ValueError(
            f"this state is already sharded over {state.mesh}; to move it to {mesh}, save it "
            "with tf.checkpoint.save and load it into a state initialised on the new mesh"
        )
    full_opt, step, rng, ls = tree_leaves(state.opt_state), state.step, state.rng, state.loss_scale
    new = init(state.model, state.tx, mesh)
    state.donate("shard")
    backend = backends.get(new.model.backend)
    for full, leaf in zip(full_opt, tree_leaves(new.opt_state), strict=True):
        backend.shard_into(leaf, full)
    return new.replace(step=step.clone(), rng=rng.clone(), loss_scale=ls)


@overload
def unshard(state: TrainState) -> dict[str, torch.Tensor]: ...
@overload
def unshard(
    state: Mapping[str, torch.Tensor], mesh: Mesh, model: Model
) -> dict[str, torch.Tensor]: ...
def unshard(
    state: TrainState | Mapping[str, torch.Tensor],
    mesh: Mesh | None = None,
    model: Model | None = None,
) -> dict[str, torch.Tensor]:
    """The trainable parameters as whole tensors (a collective on several ranks: call it on all).

    On one process these are detached views of the state's own tensors.

    ``unshard(local, mesh, model)`` inverts ``shard(params, mesh, model)``: the whole tensors in
    HF names from every rank's pieces `local` (every rank receives all pieces on the CPU,
    ``all_gather_object``: for checks and small models). Raises ``TypeError`` without `mesh`
    and `model` (or with them for a state), ``ValueError`` when the mesh does not match the
    world or the pieces do not join.
    """
    if not isinstance(state, TrainState):
        if mesh is None or model is None:
            raise TypeError("tf.unshard(local, mesh, model) needs the mesh and model of the pieces")
        if world_size() > 1:
            mesh.validate(world_size())
        return backends.get(model.backend).unshard_params(gather_tensors(state), mesh, model)
    if mesh is not None or model is not None:
        raise TypeError("tf.unshard(state) takes no mesh or model: the state carries its own")
    state.check_alive()
    return backends.get(state.model.backend).unshard(state)


def fwd_bwd(
    state: TrainState,
    batch: Mapping[str, torch.Tensor],
    accum: Grads | None = None,
    *,
    loss: TokenLoss | SequenceLoss | None = None,
    donate: bool = True,
) -> tuple[Grads, dict[str, torch.Tensor]]:
    """Gradients of the token-summed loss of `batch`; the state is never modified.

    `batch` is a padded (``input_ids``, ``labels``, ``attention_mask``, ``position_ids``, each
    ``[B, T]``) or packed (``[1, T]`` plus ``cu_seqlens``) batch with labels already shifted,
    plus any batch fields `loss` reads (each shaped like ``labels``). `loss` is the default
    cross entropy (None: each backend's fused kernel) or a `twinkle_fn.losses.TokenLoss`, a
    function of per-token log-probabilities and batch fields returning a token sum and count.
    With `accum`, this batch's gradients are added to it: `accum` is donated (reusing it raises)
    unless ``donate=False``. A sequence loss (``tf.losses.dpo_loss``...) costs one more forward
    without gradients, whose log-probabilities linearise it exactly into a `TokenLoss`
    (`twinkle_fn.losses.preference`). Returns ``(grads, aux)``, aux holding this micro-batch's
    ``loss_sum`` and ``num_tokens`` (the loss's count: pairs for a preference loss); for an
    MoE model also ``expert_load`` ``[moe_layers, experts]`` (tokens routed to each expert,
    padding excluded, summed over data ranks) and, when router losses train (model option
    ``router_loss``, `twinkle_fn.moe.RouterLoss`), their values ``aux_loss`` / ``z_loss``. A
    batch carrying ``routed_experts`` (`token_logps`' record) replays that routing. A module
    holding several LoRA adapters computes with the state's own (`twinkle_fn.lora.use_adapter`).
    A value model (``head="value"``, a critic) trains a loss that needs ``values`` (e.g.
    ``tf.losses.value_loss``). Raises `DonatedError` for a donated state or accum;
    ``TypeError`` / ``ValueError`` (before any compute) for a batch
    `twinkle_fn.batch_check.check_batch` refuses (missing labels, float ids, ids outside the
    vocabulary, sequences longer than the position table, on one process a batch without a
    supervised token), and for a `loss` that is neither, does not fit the model's head, reads
    a field `batch` lacks, or refuses the batch (see `twinkle_fn.losses.check_loss`).
    """
    state.check_alive()
    check_batch(
        batch,
        state.model.config,
        where="tf.fwd_bwd",
        supervised=True,
        single_process=world_size() == 1,
    )
    if loss is None:
        check_head(None, state.model.head)
    else:
        check_loss(loss, batch, head=state.model.head)
    if accum is not None:
        accum.check_alive()
    if is_sequence_loss(loss):
        loss, batch = loss.linearise(batch, token_logps(state, batch)["logps"])
    if accum is not None:
        accum = _take(accum, "fwd_bwd", donate)
    lora.use_adapter(state)
    return backends.get(state.model.backend).fwd_bwd(state, batch, accum, loss)


@torch.no_grad()
def evaluate(state: TrainState, batch: Mapping[str, torch.Tensor]) -> LossOutput:
    """The token-summed loss and token count of `batch` under `state`, without gradients.

    Dropout and other train-mode behaviour follow the module's mode. Raises `DonatedError` for
    a donated state, ``ValueError`` for a value model (it has no cross entropy), ``TypeError`` /
    ``ValueError`` (before any compute) for a batch `twinkle_fn.batch_check.check_batch` refuses.
    """
    state.check_alive()
    check_head(None, state.model.head)
    check_batch(batch, state.model.config, where="tf.evaluate")
    lora.use_adapter(state)
    backend = backends.get(state.model.backend)
    out = backend.loss_of(state, batch)
    backend.after_eval(state.model)
    return out


@torch.no_grad()
def token_logps(
    state: TrainState,
    batch: Mapping[str, torch.Tensor],
    *,
    temperature: float = 1.0,
    disable_lora: bool = False,
    return_logits: bool = False,
    record_routing: bool = False,
) -> dict[str, torch.Tensor]:
    """Per-token log-probabilities of `batch`'s labels under `state`, without gradients.

    Returns ``logps`` (float32, in `batch`'s layout: ``[B, T]`` padded, ``[1, T]`` packed;
    ``log softmax(logits / temperature)[label]``, 0 where the label is -100), ``loss_sum`` and
    ``num_tokens`` (the token-summed cross entropy at temperature 1 and its supervised-token
    count), and with `return_logits` ``logits`` ``[B, T, vocab]`` divided by `temperature`.
    `disable_lora` computes with the base weights alone (a reference model's log-probs). An
    MoE model with `record_routing` also returns ``routed_experts`` ``[B, T, moe_layers,
    top_k]`` int64, the experts each token was routed to (a routing-replay record,
    `twinkle_fn.moe`); a `batch` carrying one under ``"routed_experts"`` is routed by it. On
    several ranks a collective over the model's ranks. Raises `DonatedError` for a donated
    state, ``ValueError`` for a `temperature` that is not positive, `record_routing` on a
    dense model, a routing record that does not fit (`twinkle_fn.moe.check_record`), ``TypeError`` /
    ``ValueError`` for a batch `twinkle_fn.batch_check.check_batch` refuses, for what the
    backend does not offer (the megatron backend: a temperature other than 1, logits) and for a
    value model (read it with `token_values`).
    """
    state.check_alive()
    if state.model.head == "value":
        raise ValueError(
            "tf.token_logps: this is a value model (head='value'), it has no log-probabilities; "
            "read its per-token values with tf.token_values(state, batch)"
        )
    if not (isinstance(temperature, int | float) and temperature > 0):
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    check_batch(batch, state.model.config, where="tf.token_logps")
    if record_routing and family(state.model.config).moe is None:
        raise ValueError(
            f"tf.token_logps(record_routing=True) records MoE routing, but this "
            f"{state.model.family} model has no experts; drop record_routing"
        )
    lora.use_adapter(state)
    return backends.get(state.model.backend).token_logps(
        state,
        batch,
        temperature=float(temperature),
        disable_lora=disable_lora,
        return_logits=return_logits,
        record_routing=record_routing,
    )


@torch.no_grad()
def token_values(state: TrainState, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A value model's per-token value estimates of `batch`, without gradients (a rollout's
    ``old_values``).

    Returns ``values`` (float32, float64 for a float64 model; in `batch`'s layout: ``[B, T]``
    padded, ``[1, T]`` packed; the value of the state in which each label is chosen, 0 where
    the label is -100) and ``num_tokens``. On several ranks a collective over the model's ranks.
    Raises `DonatedError` for a donated state, ``ValueError`` for a model without a value head.
    """
    state.check_alive()
    if state.model.head != "value":
        raise ValueError(
            f"tf.token_values needs a value model, this one has head={state.model.head!r}; "
            "build the critic with tf.models.from_pretrained(dir, head='value')"
        )
    lora.use_adapter(state)
    return backends.get(state.model.backend).token_values(state, batch)


def grad_norm(state: TrainState, grads: Grads) -> torch.Tensor:
    """The global L2 norm of the gradients `step` would apply: `grads` divided by every data
    rank's supervised tokens (the norm `step` reports as ``info["grad_norm"]``, before
    clipping), without changing them. A 0-d tensor on the device; a collective on several
    ranks. Raises `DonatedError` for a donated state or grads.
    """
    state.check_alive()
    grads.check_alive()
    return backends.get(state.model.backend).grad_norm(state, grads)


def step(
    state: TrainState,
    grads: Grads,
    *,
    donate: bool = True,
    on_nonfinite: str | None = None,
) -> tuple[TrainState, dict[str, Any]]:
    """Apply one optimizer update from `grads`, normalised by their total token count.

    The gradients of the token sums are divided once by the number of supervised tokens of every
    accumulated micro-batch, then handed to ``state.tx``. `state` and `grads` are donated unless
    ``donate=False``. Returns the new state and ``info`` with ``loss`` (token mean), ``grad_norm``
    (before clipping), ``num_tokens`` (device tensors: no host sync) and ``lr`` (a float, or None
    when the transform has no learning rate).

    Divergence guard (`on_nonfinite`): None (the default) checks nothing, so a step never waits
    for the device. ``"raise"`` raises `NonFiniteError` naming the step and the values when the
    loss or the gradient norm is NaN or infinite, before anything is donated or written;
    ``"skip"`` then returns the state with its step and parameters unchanged (the RNG key
    advances, as on an fp16 overflow) and ``info["skipped"] = True``. Either check measures the
    gradient norm once more and syncs the host once per step (the CLI and the class API turn
    it on: they read the loss every step anyway). A float16 model is exempt: its loss scale
    already skips overflowed steps. A backend whose optimizer measures the norm inside its
    update (megatron) is guarded on the loss alone. Raises, before anything is donated (the
    state stays usable and bit-identical): `DonatedError` for a donated state or grads,
    ``TypeError`` for grads that are not `Grads` (`check_grads`), ``ValueError`` for grads of
    other parameters or shapes, a schedule giving a non-finite or negative lr at this step, an
    unknown `on_nonfinite` or ``donate=False`` on a sharded model.
    """
    state.check_alive()
    check_grads(state, grads)
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")
    check_next_lr(state)
    if not donate and state.model.placement is not None:
        raise ValueError(
            "step(donate=False) copies the state, but a sharded model computes with one set of "
            "parameters; use donate=True (save a checkpoint to keep an earlier state)"
        )
    backend = backends.get(state.model.backend)
    if on_nonfinite is not None and state.model.compute_dtype != torch.float16:
        skipped = nonfinite_guard(state, grads, on_nonfinite)
        if skipped is not None:
            new = _take(state, "step", donate)
            _take(grads, "step", donate)
            return new.replace(rng=next_key(new.rng)), skipped
    return backend.update(_take(state, "step", donate), _take(grads, "step", donate))


def _take[T: (TrainState, Grads)](obj: T, by: str, donate: bool) -> T:
    """The object a call may update in place: `obj`'s buffers (donating it) or a copy."""
    if not donate:
        return obj.copy()
    alias = obj.replace()
    obj.donate(by)
    return alias
