"""Value models (critics) in upstream Twinkle's class style: `TransformersValueModel` and
`MegatronValueModel`.

Upstream Twinkle has no critic class yet; these are `TransformersModel` / `MegatronModel` whose
core model has a value head (``tf.models.from_pretrained(dir, head="value")``: the causal LM's
body under transformers' token-classification ``score`` head with one label), built the same
way (``model_id=``, ``config=``, ``device_mesh=``...). The differences:

- ``forward_only(inputs=...)`` returns ``values`` (``[n_seq, max_len]``: each token's value,
  read where its label is predicted, 0 where the label is -100, as ``logps`` are laid out) and
  ``num_tokens`` = ``tf.token_values``; a rollout's ``old_values``;
- they train `twinkle.loss.PPOValueLoss` (the default; ``set_loss('PPOValueLoss', clip=0.2)``
  sets another clip): ``forward_backward(inputs=..., returns=..., old_values=...)`` +
  ``clip_grad_and_step()`` = ``tf.fwd_bwd(state, batch, loss=tf.losses.value_loss(clip))`` +
  ``tf.step``. A loss that needs log-probabilities, and log-probabilities themselves
  (``forward``, ``return_logps``), are refused before any compute;
- ``MegatronValueModel.forward_backward`` returns the training forward's ``values`` where
  `MegatronModel` returns ``logps``.

Checkpoints (``save`` / ``load``) and weight export work as on the LM classes; the HF files are a
token-classification model's (``AutoModelForTokenClassification.from_pretrained`` loads them).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, PretrainedConfig

import twinkle_fn as tf
from twinkle.data_format import ModelOutput
from twinkle.device_mesh import DeviceMesh
from twinkle.infra import remote_class, remote_function
from twinkle.loss import PPOValueLoss
from twinkle.model._inputs import Batch
from twinkle.model.megatron import MegatronModel
from twinkle.model.transformers import TransformersModel
from twinkle.processor import unpack


@remote_class()
class TransformersValueModel(TransformersModel):
    """A critic trained through `twinkle_fn` on the transformers backend (module docstring).

    Arguments as `TransformersModel`'s, but `model_cls` names a token-classification model
    (default ``AutoModelForTokenClassification``; the core builds the family's, with one
    label). Raises ``ValueError`` for another `model_cls`, and as `TransformersModel`.
    """

    _HEAD: ClassVar[str] = "value"

    def __init__(
        self,
        model_cls: Any = AutoModelForTokenClassification,
        model_id: str | os.PathLike[str] | None = None,
        config: PretrainedConfig | None = None,
        device_mesh: DeviceMesh | None = None,
        mixed_precision: str = "bf16",
        **kwargs: Any,
    ) -> None:
        name = model_cls if isinstance(model_cls, str) else getattr(model_cls, "__name__", "")
        if not name.endswith("ForTokenClassification"):
            raise ValueError(
                f"model_cls={model_cls!r}: a value model is a token-classification model (the "
                "causal LM's body under a one-label score head); use "
                "AutoModelForTokenClassification"
            )
        # the LM class's option checks; the core builds the critic from `_HEAD`
        super().__init__(
            AutoModelForCausalLM, model_id, config, device_mesh, mixed_precision, **kwargs
        )
        self._resolve(None).loss = PPOValueLoss()

    @remote_function(dispatch="slice_dp", collect="flatten")
    def forward_only(self, *, inputs: Any, adapter_name: str | None = None) -> ModelOutput:
        """An evaluation forward (no gradient): ``values`` ``[n_seq, max_len]`` and
        ``num_tokens`` (module docstring)."""
        g, batch = self._encode(adapter_name, inputs)
        return values_output(self._ensure_state(g), batch)


@remote_class(execute="all")
class MegatronValueModel(MegatronModel):
    """A critic trained by megatron-core through `twinkle_fn` (module docstring): megatron's
    ``GPTModel`` ending in a replicated ``[hidden] -> 1`` value head on the last pipeline
    stage. Arguments as `MegatronModel`'s (the rest by keyword)."""

    _HEAD: ClassVar[str] = "value"

    def __init__(
        self,
        model_id: str | os.PathLike[str] | None = None,
        config: PretrainedConfig | None = None,
        ddp_config: Mapping[str, Any] | None = None,
        device_mesh: DeviceMesh | None = None,
        mixed_precision: str = "bf16",
        **kwargs: Any,
    ) -> None:
        super().__init__(model_id, config, ddp_config, device_mesh, mixed_precision, **kwargs)
        self._resolve(None).loss = PPOValueLoss()

    @remote_function(dispatch="slice_dp", collect="flatten")
    def forward_only(self, *, inputs: Any, adapter_name: str | None = None) -> ModelOutput:
        """An evaluation forward (no gradient): ``values`` ``[n_seq, max_len]`` and
        ``num_tokens``, the same on every pipeline stage (module docstring)."""
        g, batch = self._encode(adapter_name, inputs)
        return values_output(self._ensure_state(g), batch)


def values_output(state: tf.TrainState, batch: Batch) -> ModelOutput:
    """``tf.token_values`` of `batch` as a `ModelOutput`: ``values`` ``[n_seq, max_len]``
    (rows of a packed batch unpacked) and ``num_tokens`` (an int)."""
    got = tf.token_values(state, batch)
    values: torch.Tensor = unpack(got["values"], batch)
    return ModelOutput(values=values, num_tokens=int(got["num_tokens"]))
