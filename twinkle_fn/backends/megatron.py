"""The megatron backend: HF model families trained on megatron-core's ``GPTModel``.

`MegatronBackend.prepare` builds this rank's pipeline stage from the model's HF config over
megatron-core's process groups (`twinkle_fn.megatron.parallel`), loads this rank's slices of the
HF weights through the bridge, wraps the stage in ``Float16Module`` (bf16 / fp16) and megatron's
``DistributedDataParallel`` (fp32 grad buffers, the distributed optimizer's layout, no overlap).
`fwd_bwd` runs megatron-core's schedule (`twinkle_fn.megatron.train`): gradients are token sums
left in the DDP grad buffers, unreduced, and the returned `Grads` are views of them. `step`
reduces them once (data parallel, sequence-parallel norms, tied embeddings across stages),
divides by the global supervised-token count, and applies the optimizer.

Optimizers. `megatron_optimizer` is the transform to use: ``tf.init`` builds megatron-core's
``DistributedOptimizer`` over the model chunks (fp32 main params, optimizer state sharded over
data-parallel ranks, clipping by the true global norm across tp / pp / ep), and the learning rate
follows a `twinkle_fn.schedules` schedule the way ``OptimizerParamScheduler`` sets it. Any other
`GradientTransformation` (``tf.optim.adamw``...) is applied to the model's own parameters, in
their own dtype (bf16 under ``precision="bf16"``: no fp32 master copy), after an all-reduce,
replicated on every data rank; it needs whole parameters on every rank (tp, pp, cp and ep of 1),
since its global norm sees only local tensors.

``Model.options`` read by `prepare`: ``num_micro_batches`` (per `fwd_bwd` call; default the
pipeline size), ``vocab_multiple`` (vocabulary padding unit per tp rank; default 128),
``use_te`` (TransformerEngine's layer spec; default when importable) and any
``TransformerConfig`` field (e.g. ``recompute_granularity``) but those the mesh, the precision
and the loss decide (parallel sizes, sequence parallelism, ``bf16`` / ``fp16``, per-token loss). A model built with
``activation_checkpointing=True`` recomputes every layer in backward (megatron's full, uniform
recompute of one layer at a time) unless the options say otherwise.

Dropout draws from megatron-core's RNG streams, seeded once when megatron's parallel state is
initialised (seed 0); the state's ``rng`` key advances with every step but does not reseed them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import optree
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.transformer.module import Float16Module
from torch import Tensor
from transformers.core_model_loading import revert_weight_conversion

from twinkle_fn.backends.hf import next_key
from twinkle_fn.losses import LossOutput
from twinkle_fn.megatron import parallel
from twinkle_fn.megatron.bridge import hf_to_mcore, mcore_to_hf
from twinkle_fn.megatron.model import build_gpt_model
from twinkle_fn.megatron.safetensors_io import SafetensorsReader
from twinkle_fn.megatron.train import forward_backward, micro_batches
from twinkle_fn.mesh import Mesh
from twinkle_fn.models.model import Model
from twinkle_fn.optim import GradientTransformation, Schedule, apply_updates, current_lr
from twinkle_fn.optim.base import advance_counter, check_lr, check_nonnegative, lr_at
from twinkle_fn.pytree import NAMESPACE, tree_global_norm
from twinkle_fn.state import Grads, TrainState

PLACEMENT_ATTR = "twinkle_placement"  # set on every parameter by `prepare`
_OWN_OPTIONS = ("num_micro_batches", "vocab_multiple", "use_te")
# TransformerConfig fields the mesh or this backend's loss and gradient handling decide.
_FIXED_FIELDS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "sequence_parallel",
    "calculate_per_token_loss",
    "finalize_model_grads_func",
    "bf16",
    "fp16",
)
# What the models' ``activation_checkpointing=True`` means in megatron's terms.
_FULL_RECOMPUTE = MappingProxyType(
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
)


@dataclasses.dataclass(eq=False)
class MegatronPlacement:
    """Where a model lives on the megatron backend (``Model.placement``).

    ``chunks``: this rank's model chunks wrapped in megatron's DDP (one: virtual pipelining is
    refused); ``module``: the unwrapped ``GPTModel`` stage, whose parameter names the state
    uses; ``live_grads``: the parameter tree of the `Grads` that owns the DDP grad buffers now
    (None when none does), so that stale gradients are refused instead of silently read.
    """

    mesh: Mesh
    chunks: list[DistributedDataParallel]
    module: torch.nn.Module
    hf_config: Any
    compute_dtype: torch.dtype
    num_micro_batches: int
    vocab_multiple: int
    live_grads: dict[str, Tensor] | None = None

    @property
    def seq_multiple(self) -> int:
        """What every micro-batch's sequence length must divide by (sequence parallelism)."""
        return self.mesh.tp if self.mesh.sequence_parallel else 1


@dataclasses.dataclass(frozen=True, eq=False)
class _Hyper:
    lr: float | Schedule
    weight_decay: float


@optree.register_pytree_node_class(namespace=NAMESPACE)
@dataclasses.dataclass(frozen=True, eq=False)
class MegatronOptState:
    """The state of `megatron_optimizer`: megatron-core's optimizer and its tensors.

    Children: ``count`` (int64, updates applied) and ``lr`` (float64, the last update's lr),
    0-d CPU tensors; ``slots``: per parameter name, the optimizer's tensors for the part of it
    this data rank owns (``exp_avg``, ``exp_avg_sq``, ``step``; ``main_param`` when the fp32
    master copy is a separate tensor) -- the very tensors the optimizer steps. Static: the
    megatron ``ChainedOptimizer`` and the hyper-parameters.
    """

    count: Tensor
    lr: Tensor
    slots: dict[str, dict[str, Tensor]]
    optimizer: Any = dataclasses.field(repr=False)
    hyper: _Hyper = dataclasses.field(repr=False)

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[str, ...]]:
        """optree protocol: tensor children, static metadata, child names."""
        children = (self.count, self.lr, self.slots)
        return children, (self.optimizer, self.hyper), ("count", "lr", "slots")

    @classmethod
    def tree_unflatten(cls, meta: tuple[Any, ...], children: tuple[Any, ...]) -> MegatronOptState:
        """optree protocol: rebuild from `tree_flatten`'s output."""
        return cls(*children, *meta)


def megatron_optimizer(
    lr: float | Schedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    clip_grad: float = 1.0,
    loss_scale: float | None = None,
    initial_loss_scale: float = 2.0**32,
) -> GradientTransformation:
    """AdamW through megatron-core's distributed optimizer, for the megatron backend.

    ``init`` (called by ``tf.init`` with the parameters of a model prepared by the megatron
    backend) builds ``get_megatron_optimizer`` over its model chunks: fp32 main parameters,
    Adam moments sharded over data-parallel ranks, gradients clipped to global norm `clip_grad`
    (0 disables; the norm spans tp, pp and ep shards, each element once), decoupled weight decay
    on matrices only (megatron skips biases and 1-d tensors, as `tf.optim.default_decay_mask`
    does for these families). `lr` is a float or a `twinkle_fn.schedules` schedule called with
    the number of updates applied; every update writes it (times the group's ``lr_mult``) into
    the optimizer's parameter groups, as ``OptimizerParamScheduler.step`` does. fp16 only:
    `loss_scale` is a constant loss scale, or None for megatron's dynamic scaler starting at
    `initial_loss_scale` (an update that overflows is skipped: parameters, moments and the
    schedule's count stay, and ``step`` reports a NaN ``grad_norm``). ``update`` is applied
    by the backend's ``step``; calling it directly raises ``TypeError``. Raises ``ValueError``
    for an out-of-range hyper-parameter, and ``init`` ``TypeError`` for parameters that do not
    come from the megatron backend.
    """
    lr = check_lr(lr)
    hyper = _Hyper(lr, check_nonnegative("weight_decay", weight_decay))
    adam = dict(
        adam_beta1=check_nonnegative("b1", b1, below_one=True),
        adam_beta2=check_nonnegative("b2", b2, below_one=True),
        adam_eps=check_nonnegative("eps", eps),
        clip_grad=check_nonnegative("clip_grad", clip_grad),
        loss_scale=None if loss_scale is None else check_nonnegative("loss_scale", loss_scale),
        initial_loss_scale=check_nonnegative("initial_loss_scale", initial_loss_scale),
    )

    def init(params: Mapping[str, Tensor]) -> MegatronOptState:
        placement = _placement_of(params)
        dtype = placement.compute_dtype
        config = OptimizerConfig(
            optimizer="adam",
            lr=lr_at(lr, torch.zeros((), dtype=torch.int64)),
            weight_decay=hyper.weight_decay,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            params_dtype=dtype,
            use_distributed_optimizer=True,
            **adam,
        )
        optimizer = get_megatron_optimizer(config, placement.chunks)
        if config.fp16:
            placement.module.config.grad_scale_func = optimizer.scale_loss
        _init_adam_states(optimizer)
        count, last_lr = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.float64)
        return MegatronOptState(count, last_lr, _slots(optimizer, params), optimizer, hyper)

    def update(updates: Any, state: Any, params: Any = None) -> Any:
        raise TypeError(
            "megatron_optimizer is applied by the megatron backend's tf.step; build the model "
            "with backend='megatron' and call tf.step(state, grads)"
        )

    return GradientTransformation(init, update)


def _placement_of(params: Mapping[str, Tensor]) -> MegatronPlacement:
    placements = {id(getattr(p, PLACEMENT_ATTR, None)) for p in params.values()}
    placement = getattr(next(iter(params.values()), None), PLACEMENT_ATTR, None)
    if placement is None or len(placements) != 1:
        raise TypeError(
            "megatron_optimizer needs the parameters of one model prepared by the megatron "
            "backend: build it with tf.models.from_hf_config(..., backend='megatron') and "
            "call tf.init(model, megatron_optimizer(...), mesh)"
        )
    return placement


def _init_adam_states(optimizer: Any) -> None:
    """Create torch Adam's per-parameter state now rather than at the first step, exactly as
    ``torch.optim.AdamW`` would, so the state tree is complete from ``tf.init`` on. Fused
    optimizers (TransformerEngine's, apex's) keep their lazy initialisation."""
    for sub in optimizer.chained_optimizers:
        inner = sub.optimizer
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            if group.get("fused") or group.get("capturable") or group.get("amsgrad"):
                continue
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p].update(
                        step=torch.tensor(0.0, dtype=_scalar_dtype()),
                        exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                        exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format),
                    )


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _slots(optimizer: Any, params: Mapping[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """Per parameter name, the optimizer tensors of this data rank's part of it."""
    names = {id(p): n for n, p in params.items()}
    slots: dict[str, dict[str, Tensor]] = {}
    for sub in optimizer.chained_optimizers:
        if not isinstance(sub, DistributedOptimizer):
            raise TypeError(f"expected megatron's DistributedOptimizer, got {type(sub).__name__}")
        for model_param, (group, order) in sub.model_param_group_index_map.items():
            main = sub.optimizer.param_groups[group]["params"][order]
            slot = {k: v for k, v in sub.optimizer.state[main].items() if isinstance(v, Tensor)}
            if main.dtype != model_param.dtype:
                slot["main_param"] = main
            slots[names[id(model_param)]] = slot
    return slots


class MegatronBackend:
    """`twinkle_fn.backends.base.Backend` over megatron-core (see the module docstring)."""

    def prepare(self, model: Model, mesh: Mesh) -> Model:
        """Build, load and wrap this rank's ``GPTModel`` stage for `mesh` (every rank calls it).

        Starts a one-rank process group when there is none and `mesh` has one rank, and
        megatron-core's parallel state (seed 0) unless it is already initialised for `mesh`.
        Raises ``ValueError`` for unknown options, a mesh other than the one the model or
        megatron-core is already placed on, or as ``build_gpt_model`` does; ``RuntimeError``
        without a process group on a multi-rank mesh or when the weights do not fit the model.
        """
        if model.placement is not None:
            if model.placement.mesh != mesh:
                raise ValueError(
                    f"this model is already placed on {model.placement.mesh}, not {mesh}; "
                    "build a new model for another mesh"
                )
            return model
        num_micro_batches, vocab_multiple, use_te, overrides = _options(model.options, mesh)
        if getattr(model.module, "is_gradient_checkpointing", False):
            overrides = {**_FULL_RECOMPUTE, **overrides}
        _ensure_process_group(mesh)
        _ensure_parallel_state(mesh)
        dtype = model.compute_dtype
        gpt = build_gpt_model(
            model.config,
            mesh,
            use_te=use_te,
            vocab_multiple=vocab_multiple,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            **overrides,
        )
        _load_weights(gpt, model, mesh, vocab_multiple)
        wrapped = gpt if dtype == torch.float32 else Float16Module(gpt.config, gpt)
        placement = MegatronPlacement(
            mesh=mesh,
            chunks=[_ddp(gpt, wrapped)],
            module=gpt,
            hf_config=model.config,
            compute_dtype=dtype,
            num_micro_batches=num_micro_batches,
            vocab_multiple=vocab_multiple,
        )
        for p in gpt.parameters():
            setattr(p, PLACEMENT_ATTR, placement)
        return dataclasses.replace(model, placement=placement)

    def trainable(self, model: Model) -> dict[str, Tensor]:
        """This rank's ``GPTModel`` parameters with ``requires_grad``, by megatron name.

        Each carries its placement as attribute `PLACEMENT_ATTR`, which `megatron_optimizer`'s
        ``init`` reads. Raises ``ValueError`` for a model not prepared by this backend.
        """
        placement = _placement(model)
        return {n: p for n, p in placement.module.named_parameters() if p.requires_grad}

    def loss_of(self, state: TrainState, batch: Mapping[str, Tensor]) -> LossOutput:
        """Token-summed loss and supervised-token count of `batch` (forward only, no graph).

        Runs megatron's schedule without backward; the result is the same on every pipeline
        stage. Raises ``ValueError`` as `twinkle_fn.megatron.train.micro_batches` does.
        """
        placement = _placement(state.model)
        loss_sum, num_tokens = forward_backward(
            placement.chunks,
            _micro_batches(placement, batch),
            placement.hf_config.vocab_size,
            forward_only=True,
        )
        return LossOutput(loss_sum, num_tokens)

    def fwd_bwd(
        self, state: TrainState, batch: Mapping[str, Tensor], accum: Grads | None
    ) -> tuple[Grads, dict[str, Tensor]]:
        """Token-sum gradients of `batch`, accumulated in the DDP grad buffers.

        Without `accum` the buffers are zeroed first; with it, `accum` must be the `Grads` that
        owns them (the latest one, donated). Returns `Grads` whose tensors are views of the
        buffers (this rank's unreduced sums) and this call's ``loss_sum`` / ``num_tokens``.
        Raises ``ValueError`` for a stale or copied `accum`, or a malformed batch.
        """
        placement = _placement(state.model)
        if accum is None:
            for chunk in placement.chunks:
                chunk.zero_grad_buffer()
            params = {n: p.main_grad for n, p in state.params.items()}
            placement.live_grads = params
        else:
            params = _live(placement, accum, "fwd_bwd(accum=...)")
        mbs = _micro_batches(placement, batch)
        loss_sum, num_tokens = forward_backward(
            placement.chunks, mbs, placement.hf_config.vocab_size
        )
        aux = {"loss_sum": loss_sum, "num_tokens": num_tokens}
        if accum is not None:
            loss_sum = accum.loss_sum + loss_sum
            num_tokens = accum.num_tokens + num_tokens
        done = 0 if accum is None else accum.num_micro_batches
        return Grads(params, loss_sum, num_tokens, num_micro_batches=done + len(mbs)), aux

    def update(self, state: TrainState, grads: Grads) -> tuple[TrainState, dict[str, Any]]:
        """Reduce `grads` once, divide by every data rank's tokens, apply the optimizer.

        Returns the new state and ``info`` with ``loss``, ``grad_norm`` (before clipping; NaN
        when an fp16 overflow skipped the update), ``num_tokens`` and ``lr``. Raises
        ``ValueError`` for stale grads, or for a non-megatron transform on a mesh that splits
        parameters.
        """
        placement = _placement(state.model)
        _live(placement, grads, "step")
        opt = state.opt_state
        if not isinstance(opt, MegatronOptState):
            _check_whole_params(placement.mesh)
        placement.live_grads = None
        totals = torch.stack([grads.loss_sum.double(), grads.num_tokens.double()])
        dist.all_reduce(
            totals, group=parallel_state.get_data_parallel_group(with_context_parallel=True)
        )
        loss_sum, num_tokens = totals[0], totals[1].long()
        if isinstance(opt, MegatronOptState):
            grad_norm, opt = _megatron_update(placement, opt, num_tokens)
        else:
            grad_norm, opt = _transform_update(state, placement, grads, num_tokens)
        new = state.replace(opt_state=opt, step=state.step + 1, rng=next_key(state.rng))
        info = {
            "loss": (loss_sum / num_tokens.clamp(min=1)).float(),
            "grad_norm": grad_norm,
            "num_tokens": num_tokens,
            "lr": current_lr(opt),
        }
        return new, info

    def after_eval(self, model: Model) -> None:
        """Nothing to release: megatron's forward keeps no gathered parameters."""

    def unshard(self, state: TrainState) -> dict[str, Tensor]:
        """Every parameter as a whole HF tensor, by HF checkpoint name (a collective).

        Gathers one copy of each tp / pp / ep shard on every rank and joins them with the
        bridge's `mcore_to_hf` (MoE experts come out one tensor per expert). CPU tensors in
        the model's parameter dtype.
        """
        placement = _placement(state.model)
        mesh, rank = placement.mesh, dist.get_rank()
        coords, expert = mesh.coords(rank), mesh.expert_coords(rank)
        sends_dense = mesh.data_rank(rank) == 0 and coords["cp"] == 0
        sends_expert = expert["edp"] == 0
        local = {
            n: p.detach().cpu()
            for n, p in placement.module.named_parameters()
            if (sends_expert if _is_expert(p) else sends_dense)
        }
        key = (coords["tp"], coords["pp"], expert["ep"], expert["etp"])
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (key, sends_dense, local))
        dense = {k[:2]: part for k, is_dense, part in gathered if is_dense}
        states = {k: {**dense[k[:2]], **part} for k, _, part in gathered if part}
        return dict(
            mcore_to_hf(
                states,
                placement.hf_config,
                tp_size=mesh.tp,
                pp_size=mesh.pp,
                ep_size=mesh.ep,
                etp_size=mesh.etp,
                vocab_multiple=placement.vocab_multiple,
            )
        )


def _placement(model: Model) -> MegatronPlacement:
    placement = model.placement
    if not isinstance(placement, MegatronPlacement):
        raise ValueError(
            "this model is not prepared by the megatron backend; build it with "
            "backend='megatron' and initialise it with tf.init(model, tx, mesh)"
        )
    return placement


def _options(options: Mapping[str, Any], mesh: Mesh) -> tuple[int, int, bool | None, dict]:
    """``(num_micro_batches, vocab_multiple, use_te, TransformerConfig overrides)``."""
    fixed = sorted(set(options) & set(_FIXED_FIELDS))
    if fixed:
        raise ValueError(
            f"option(s) {', '.join(fixed)} are set by the mesh and the megatron backend (tp, pp, "
            "cp, ep, etp and sequence_parallel from twinkle_fn.Mesh, precision from the model; "
            "virtual pipeline parallelism is not supported yet); drop them from the options"
        )
    overrides = {k: v for k, v in options.items() if k not in _OWN_OPTIONS}
    num = options.get("num_micro_batches", mesh.pp)
    multiple = options.get("vocab_multiple", 128)
    for name, value in (("num_micro_batches", num), ("vocab_multiple", multiple)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"option {name} must be a positive int, got {value!r}")
    return num, multiple, options.get("use_te"), overrides


def _ensure_process_group(mesh: Mesh) -> None:
    if dist.is_initialized():
        return
    if mesh.world_size != 1:
        raise RuntimeError(
            f"{mesh} needs {mesh.world_size} processes joined by torch.distributed; launch with "
            "torchrun and call twinkle_fn.distributed.init_distributed() first"
        )
    # megatron-core needs a process group even on one process: an in-memory one-rank store.
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def _ensure_parallel_state(mesh: Mesh) -> None:
    if not parallel_state.model_parallel_is_initialized():
        parallel.initialize(mesh, seed=0)
        return
    live = dict(
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(),
        cp=parallel_state.get_context_parallel_world_size(),
        ep=parallel_state.get_expert_model_parallel_world_size(),
        etp=parallel_state.get_expert_tensor_parallel_world_size(),
        data=parallel_state.get_data_parallel_world_size(),
    )
    wanted = dict(
        tp=mesh.tp, pp=mesh.pp, cp=mesh.cp, ep=mesh.ep, etp=mesh.etp, data=mesh.data_world_size
    )
    if live != wanted:
        raise ValueError(
            f"megatron-core is initialised for {live}, but the mesh asks for {wanted}; call "
            "twinkle_fn.megatron.parallel.destroy() before preparing a model on another mesh"
        )


def _load_weights(gpt: torch.nn.Module, model: Model, mesh: Mesh, vocab_multiple: int) -> None:
    """Copy this rank's slices of the model's HF weights into `gpt` (read from the files when
    the model has a ``weights_dir``, else from its module, in HF checkpoint names)."""
    rank = dist.get_rank()
    coords, expert = mesh.coords(rank), mesh.expert_coords(rank)
    if model.weights_dir is not None:
        with SafetensorsReader(model.weights_dir) as reader:
            _load_local(gpt, reader, model, coords, expert, mesh, vocab_multiple)
    else:
        state = revert_weight_conversion(model.module, model.module.state_dict())
        _load_local(gpt, state, model, coords, expert, mesh, vocab_multiple)


def _load_local(
    gpt: torch.nn.Module,
    source: Any,
    model: Model,
    coords: dict[str, int],
    expert: dict[str, int],
    mesh: Mesh,
    vocab_multiple: int,
) -> None:
    local = hf_to_mcore(
        source,
        model.config,
        tp_rank=coords["tp"],
        tp_size=mesh.tp,
        pp_rank=coords["pp"],
        pp_size=mesh.pp,
        ep_rank=expert["ep"],
        ep_size=mesh.ep,
        etp_rank=expert["etp"],
        etp_size=mesh.etp,
        vocab_multiple=vocab_multiple,
    )
    missing, unexpected = gpt.load_state_dict(local, strict=False)
    missing = [k for k in missing if not k.endswith("._extra_state")]
    if missing or unexpected:
        raise RuntimeError(
            f"the HF weights do not fit the megatron model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )


def _ddp(gpt: torch.nn.Module, wrapped: torch.nn.Module) -> DistributedDataParallel:
    """megatron's DDP around `wrapped`: fp32 grad buffers laid out for the distributed
    optimizer, reductions when `step` asks for them (no overlap with backward)."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=True,
    )
    layout = DistributedOptimizer.compute_full_param_layout(
        [p for p in wrapped.parameters() if p.requires_grad],
        None,
        parallel_state.get_data_parallel_world_size(
            with_context_parallel=True, partial_data_parallel=True
        ),
        ddp_config,
        expert_data_parallel_world_size=parallel_state.get_expert_data_parallel_world_size(
            partial_expert_data_parallel=True
        ),
    )
    return DistributedDataParallel(gpt.config, ddp_config, wrapped, full_param_layout=layout)


def _micro_batches(placement: MegatronPlacement, batch: Mapping[str, Tensor]) -> list[Any]:
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    return micro_batches(
        batch, placement.num_micro_batches, seq_multiple=placement.seq_multiple, device=device
    )


def _live(placement: MegatronPlacement, grads: Grads, where: str) -> dict[str, Tensor]:
    if grads.params is not placement.live_grads:
        raise ValueError(
            f"{where} got gradients that no longer own megatron's grad buffers (a later fwd_bwd "
            "or step reused them, or they are a copy); pass the Grads of the latest fwd_bwd, "
            "donated (donate=True)"
        )
    return grads.params


def _is_expert(param: Tensor) -> bool:
    """megatron marks expert-parallel parameters with ``allreduce=False``."""
    return not getattr(param, "allreduce", True)


def _check_whole_params(mesh: Mesh) -> None:
    if mesh.tp > 1 or mesh.pp > 1 or mesh.cp > 1 or mesh.ep > 1:
        raise ValueError(
            f"a twinkle_fn.optim transform needs whole parameters on every rank, but {mesh} "
            "splits them (its global norm would see only local shards); use "
            "twinkle_fn.backends.megatron.megatron_optimizer(...)"
        )


def _megatron_update(
    placement: MegatronPlacement, opt: MegatronOptState, num_tokens: Tensor
) -> tuple[Tensor, MegatronOptState]:
    finalize_model_grads(placement.chunks)
    for chunk in placement.chunks:
        chunk.scale_gradients(1.0 / num_tokens.clamp(min=1).double())
    lr = lr_at(opt.hyper.lr, opt.count)
    optimizer = opt.optimizer
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
        group["weight_decay"] = opt.hyper.weight_decay * group.get("wd_mult", 1.0)
    ok, grad_norm, _ = optimizer.step()
    if ok:
        advance_counter(opt.count, opt.lr, lr)
    norm = torch.tensor(float("nan") if grad_norm is None else grad_norm, dtype=torch.float32)
    names = dict(placement.module.named_parameters())
    return norm, dataclasses.replace(opt, slots=_slots(optimizer, names))


def _transform_update(
    state: TrainState, placement: MegatronPlacement, grads: Grads, num_tokens: Tensor
) -> tuple[Tensor, Any]:
    finalize_model_grads(placement.chunks, force_all_reduce=True)
    for chunk in placement.chunks:
        chunk.scale_gradients(1.0 / num_tokens.clamp(min=1).double())
    g = {n: t.to(state.params[n].dtype) for n, t in grads.params.items()}
    grad_norm = tree_global_norm(g)
    updates, opt = state.tx.update(g, state.opt_state, state.params)
    apply_updates(state.params, updates)
    return grad_norm, opt
