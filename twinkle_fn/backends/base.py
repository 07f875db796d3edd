"""The interface every backend implements: what `twinkle_fn.api` calls underneath.

A backend owns how a `Model` is placed on a mesh, how a batch's token-summed loss and gradients
are computed, and how an optimizer update is applied. The API functions keep the contracts that
do not depend on the backend: donation, argument checks, and the shape of what is returned.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from twinkle_fn.losses import LossOutput
from twinkle_fn.mesh import Mesh
from twinkle_fn.models.model import Model
from twinkle_fn.state import Grads, TrainState


class Backend(Protocol):
    """Hooks of one backend (all but `prepare` receive a live, non-donated state)."""

    def prepare(self, model: Model, mesh: Mesh) -> Model:
        """`model` placed on `mesh` (sharded or built per rank); a no-op on one process."""
        ...

    def trainable(self, model: Model) -> dict[str, torch.Tensor]:
        """The parameters the optimizer updates, by name (the state's ``params``)."""
        ...

    def loss_of(self, state: TrainState, batch: Mapping[str, torch.Tensor]) -> LossOutput:
        """The token-summed loss of `batch` (differentiable) and its supervised-token count."""
        ...

    def fwd_bwd(
        self, state: TrainState, batch: Mapping[str, torch.Tensor], accum: Grads | None
    ) -> tuple[Grads, dict[str, torch.Tensor]]:
        """Gradients of the token-summed loss, added into `accum` (already taken) if given."""
        ...

    def update(self, state: TrainState, grads: Grads) -> tuple[TrainState, dict[str, Any]]:
        """One optimizer update from `grads` (both taken: may be updated in place)."""
        ...

    def after_eval(self, model: Model) -> None:
        """Release what a forward without backward left behind."""
        ...

    def settle(self, model: Model) -> None:
        """Finish what the last step still writes into the parameters in the background, before
        they are read or written outside a forward."""
        ...

    def unshard(self, state: TrainState) -> dict[str, torch.Tensor]:
        """The trainable parameters as whole tensors (a collective on several ranks)."""
        ...
