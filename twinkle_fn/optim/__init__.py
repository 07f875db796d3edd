"""Optax-style optimizers over in-place torch kernels: `adamw`, `adamw_bf16` (bf16 moments and
stochastically rounded bf16 parameters), `sgd`, `muon`, `clip_by_global_norm`,
composed with `chain` and applied with `apply_updates` (a `ScaledUpdates` carries a factor not yet
multiplied in to the transformations that take one, `materialise` multiplies it in); and
`megatron_optimizer`, megatron-core's distributed optimizer, for the megatron backend."""

from twinkle_fn.optim.adamw import AdamWState, adamw
from twinkle_fn.optim.adamw_bf16 import AdamWBf16State, adamw_bf16
from twinkle_fn.optim.base import (
    EmptyState,
    GradientTransformation,
    OptState,
    Params,
    ScaledUpdates,
    Schedule,
    Updates,
    apply_updates,
    chain,
    current_lr,
    materialise,
)
from twinkle_fn.optim.clip import clip_by_global_norm
from twinkle_fn.optim.masks import DecayMask, default_decay_mask, resolve_mask
from twinkle_fn.optim.megatron import megatron_optimizer
from twinkle_fn.optim.muon import MuonState, muon
from twinkle_fn.optim.sgd import SGDState, sgd

__all__ = [
    "AdamWBf16State",
    "AdamWState",
    "DecayMask",
    "EmptyState",
    "GradientTransformation",
    "MuonState",
    "OptState",
    "Params",
    "SGDState",
    "ScaledUpdates",
    "Schedule",
    "Updates",
    "adamw",
    "adamw_bf16",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "current_lr",
    "default_decay_mask",
    "materialise",
    "megatron_optimizer",
    "muon",
    "resolve_mask",
    "sgd",
]
