"""The interface every backend implements: the one door through which the core and the facade
reach a backend.

A backend owns how a `Model` is placed on a mesh, how a batch's token-summed loss and gradients
are computed, how an optimizer update is applied, how its tensors are gathered, cut, saved and
loaded, and how LoRA adapters are built on it. The API functions (`twinkle_fn.api`,
`twinkle_fn.checkpoint`, `twinkle_fn.lora`, `twinkle_fn.offload`) keep the contracts that do not
depend on the backend: donation, argument checks, atomic directories, and the shape of what is
returned. They find a backend with `twinkle_fn.backends.get(model.backend)` and never import a
backend's modules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from peft import LoraConfig

from twinkle_fn.losses import LossOutput, TokenLoss
from twinkle_fn.mesh import Mesh
from twinkle_fn.models.model import Model
from twinkle_fn.state import Grads, TrainState
from twinkle_fn.tensor_specs import TensorSpec


class Backend(Protocol):
    """Hooks of one backend (all but `prepare` receive a live, non-donated state)."""

    # Building.
    reads_own_weights: bool
    """Whether each rank reads its own slices of a checkpoint when the model is placed (then
    `twinkle_fn.models.from_pretrained` builds a meta skeleton and loads nothing)."""

    offers_grad_norm: bool
    """Whether `grad_norm` measures the gradients before `update` (megatron's optimizer measures
    them only inside its update, so `tf.step`'s divergence guard checks the loss alone there)."""

    heads: tuple[str, ...]
    """The `twinkle_fn.models.model.HEADS` this backend builds (``"value"``: a critic, whose
    module gives one value per token; `fwd_bwd` then hands a loss ``values`` instead of
    ``logps``)."""

    def module_device(self) -> torch.device:
        """Where a freshly built HF module lives unless the caller says otherwise."""
        ...

    def adopt(self, module: torch.nn.Module) -> None:
        """Ready a freshly built HF module for this backend, in place (before adapters)."""
        ...

    def prepare(self, model: Model, mesh: Mesh) -> Model:
        """`model` placed on `mesh` (sharded or built per rank); a no-op on one process."""
        ...

    def trainable(self, model: Model) -> dict[str, torch.Tensor]:
        """The parameters the optimizer updates, by name (the state's ``params``)."""
        ...

    def initial_loss_scale(self, model: Model, scale: float) -> Any:
        """The train state's ``loss_scale`` for a fresh state of `model` (None when the
        backend scales the loss itself or the model does not compute in float16)."""
        ...

    # Computation.
    def loss_of(self, state: TrainState, batch: Mapping[str, torch.Tensor]) -> LossOutput:
        """The token-summed loss of `batch` (differentiable) and its supervised-token count."""
        ...

    def fwd_bwd(
        self,
        state: TrainState,
        batch: Mapping[str, torch.Tensor],
        accum: Grads | None,
        loss: TokenLoss | None,
    ) -> tuple[Grads, dict[str, torch.Tensor]]:
        """Gradients of the token-summed loss, added into `accum` (already taken) if given.

        `loss` None is the default cross entropy (the backend's fused kernel); a `TokenLoss`
        (already checked against `batch` and the model's head by
        `twinkle_fn.losses.check_loss`) runs on the per-token log-probabilities, and the
        entropy when it needs it, in float32; on a value model, on the per-token values.
        An MoE model adds `twinkle_fn.moe.RouterPass.info` to the returned dict, trains the
        model's router losses and replays a batch's ``routed_experts``."""
        ...

    def token_logps(
        self,
        state: TrainState,
        batch: Mapping[str, torch.Tensor],
        *,
        temperature: float,
        disable_lora: bool,
        return_logits: bool,
        record_routing: bool,
    ) -> dict[str, torch.Tensor]:
        """Per-token ``log p(label)`` of `batch` without gradients: ``logps`` (float32, in
        `batch`'s layout, 0 where the label is -100), ``loss_sum``, ``num_tokens`` and, when
        asked, ``logits`` and an MoE model's ``routed_experts`` (`twinkle_fn.moe`); a batch's
        ``routed_experts`` is replayed."""
        ...

    def token_values(
        self, state: TrainState, batch: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """A value model's per-token values of `batch` without gradients: ``values``
        (``[B, T]`` float32, float64 for a float64 model, in `batch`'s layout, 0 where the
        label is -100) and ``num_tokens``."""
        ...

    def optimizer(self, lr: Any, **hyper: Any) -> Any:
        """The backend's own AdamW `GradientTransformation` with megatron's hyper-parameter
        names (``b1``, ``b2``, ``eps``, ``weight_decay``, ``clip_grad``, ``loss_scale``,
        ``initial_loss_scale``)."""
        ...

    def update(self, state: TrainState, grads: Grads) -> tuple[TrainState, dict[str, Any]]:
        """One optimizer update from `grads` (both taken: may be updated in place)."""
        ...

    def grad_norm(self, state: TrainState, grads: Grads) -> torch.Tensor:
        """The global L2 norm of the gradients `update` would apply (divided by every data
        rank's tokens, loss scale removed), without changing them (a collective)."""
        ...

    def after_eval(self, model: Model) -> None:
        """Release what a forward without backward left behind."""
        ...

    def settle(self, model: Model) -> None:
        """Finish what the last step still writes into the parameters in the background, before
        they are read or written outside a forward."""
        ...

    # Tensors in and out.
    def unshard(self, state: TrainState) -> dict[str, torch.Tensor]:
        """The trainable parameters as whole tensors (a collective on several ranks)."""
        ...

    def shard_params(
        self, full: Mapping[str, torch.Tensor], mesh: Mesh, model: Model, rank: int
    ) -> dict[str, torch.Tensor]:
        """The pieces of the whole HF-named tensors `full` that `rank` of `mesh` holds once
        `model` is placed there, keyed as the state's ``params`` are, cut by the specs or rules
        this backend places with. Pure: no communication, any rank may be asked."""
        ...

    def unshard_params(
        self, pieces_by_rank: Mapping[int, Mapping[str, torch.Tensor]], mesh: Mesh, model: Model
    ) -> dict[str, torch.Tensor]:
        """The whole HF-named tensors whose pieces on each rank of `mesh` are
        ``pieces_by_rank[rank]`` (the inverse of `shard_params` over every rank). Pure."""
        ...

    def shard_into(self, dst: torch.Tensor, full: torch.Tensor) -> None:
        """Fill `dst` (one of this backend's tensors, a shard or whole) with its part of the
        whole tensor `full`, cut locally (no communication)."""
        ...

    def save(self, state: TrainState, directory: Path) -> dict[str, Any]:
        """Write `state` into the existing `directory` (every rank calls it); returns what the
        manifest records about the layout (JSON-able)."""
        ...

    def hf_specs(self, state: TrainState) -> tuple[dict[str, TensorSpec], frozenset[str]]:
        """What the HF files (safetensors) of a checkpoint of `state`'s model hold, as `save`
        writes them: each tensor's name, whole shape and dtype; and the names a checkpoint may
        hold or omit (tied aliases). The API checks a directory against it before a load
        writes anything (`twinkle_fn.tensor_specs.check_specs`)."""
        ...

    def load(self, state: TrainState, directory: Path, manifest: Mapping[str, Any]) -> TrainState:
        """`state` filled from the checkpoint in `directory`, whose HF files were checked
        against `hf_specs`. Everything is read and checked (the training state's tensors too:
        names, shapes, dtypes, finiteness) before the first element of `state` is written: a
        refused load leaves `state` as it was (the API donates it only once this returns)."""
        ...

    def load_weights(
        self, state: TrainState, directory: Path, rename: Callable[[str], str] | None
    ) -> None:
        """Copy the HF weights (safetensors) in `directory` into the state's parameters, in
        place, each file key passed through `rename` first. Names and shapes were checked by
        the API; what is read is checked finite before the first parameter is written."""
        ...

    # LoRA.
    def add_lora(
        self, model: Model, config: LoraConfig | Mapping[str, Any], adapter_name: str
    ) -> Model:
        """`model` with LoRA adapter `adapter_name` of `config`, base weights frozen."""
        ...

    def adapter_names(self, model: Model) -> list[str]:
        """The adapters `model` holds, in the order added."""
        ...

    def set_adapter(self, model: Model, adapter_name: str) -> None:
        """Make `adapter_name` the active adapter of `model`."""
        ...

    def use_adapter(self, state: TrainState) -> None:
        """Activate the adapter whose weights `state` trains before computing with it."""
        ...

    def adapter_state_dict(self, state: TrainState) -> dict[str, torch.Tensor]:
        """The trained adapter's whole tensors, keyed as in a peft adapter file."""
        ...

    def adapter_config(self, state: TrainState) -> LoraConfig:
        """The peft config of the adapter `state` trains."""
        ...

    # Weights out.
    def export_weights(
        self, state: TrainState, dtype: torch.dtype, bucket_bytes: int, lora: str
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The model's whole HF-named tensors in `dtype` on its device, in buckets of at most
        `bucket_bytes` (one larger tensor alone), each gathered inside the ranks that hold it;
        the same buckets on every rank (a collective). ``lora`` is ``"separate"`` (a training
        adapter's peft-named tensors only) or ``"merged"`` (base weights with it merged), as in
        `twinkle_fn.export.export_weights`, which checks the arguments."""
        ...
