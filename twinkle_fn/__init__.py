"""twinkle_fn: the functional training core.

Immutable train states (optree pytrees) and pure functions over them::

    import twinkle_fn as tf

    model = tf.models.from_hf_config(config)
    state = tf.init(model, tf.optim.adamw(tf.schedules.warmup_cosine(1e-3, 10, 100)))
    grads, aux = tf.fwd_bwd(state, batch)
    state, info = tf.step(state, grads)
    for bucket in tf.export_weights(state):  # HF-named weights, streamed to an engine
        engine.load_weights(bucket)
"""

from twinkle_fn import checkpoint, data, lora, losses, models, optim, pytree, schedules
from twinkle_fn.api import (
    NonFiniteError,
    evaluate,
    fwd_bwd,
    grad_norm,
    init,
    shard,
    step,
    token_logps,
    token_values,
    unshard,
)
from twinkle_fn.export import export_weights
from twinkle_fn.mesh import Mesh
from twinkle_fn.offload import Offloaded, offload, reload
from twinkle_fn.sharding import ShardSpec, local_shard
from twinkle_fn.state import DonatedError, Grads, TrainState

__all__ = [
    "DonatedError",
    "Grads",
    "Mesh",
    "NonFiniteError",
    "Offloaded",
    "ShardSpec",
    "TrainState",
    "checkpoint",
    "data",
    "evaluate",
    "export_weights",
    "fwd_bwd",
    "grad_norm",
    "init",
    "local_shard",
    "lora",
    "losses",
    "models",
    "offload",
    "optim",
    "pytree",
    "reload",
    "schedules",
    "shard",
    "step",
    "token_logps",
    "token_values",
    "unshard",
]
