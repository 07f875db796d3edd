"""Which parameters get weight decay.

A decay mask is ``None`` (decay every leaf), a predicate ``(path, tensor) -> bool`` called with the
dotted PyTorch-style name of each leaf, or a pytree of bools shaped like the parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from twinkle_fn.optim.base import tensor_leaves_like
from twinkle_fn.pytree import PyTree, tree_flatten_with_path, tree_leaves, tree_structure

DecayMask = None | Callable[[str, torch.Tensor], bool] | PyTree


def default_decay_mask(path: str, tensor: torch.Tensor) -> bool:
    """Decay matrices, not biases or norm scales: ``tensor.ndim >= 2`` and ``"norm"`` does not
    occur in `path` (case-insensitive, so ``input_layernorm``, ``model.norm`` and BERT's
    ``LayerNorm`` are all excluded). Embeddings are 2-D and therefore decayed."""
    return tensor.dim() >= 2 and "norm" not in path.lower()


def resolve_mask(mask: DecayMask, params: PyTree) -> list[bool]:
    """One bool per leaf of `params`, in leaf order: whether that leaf gets weight decay.

    Raises ``ValueError`` if a pytree mask is not shaped like `params`, and ``TypeError`` if the
    mask (or the predicate's result) holds something other than Python bools.
    """
    named = tree_flatten_with_path(params)
    if mask is None:
        return [True] * len(named)
    if callable(mask):
        flags = [mask(path, leaf) for path, leaf in named]
    else:
        if tree_structure(mask) != tree_structure(params):
            raise ValueError(
                "mask must be shaped like the params (one bool per parameter): got "
                f"{tree_structure(mask)}, expected {tree_structure(params)}"
            )
        flags = tree_leaves(mask)
    for (path, _), flag in zip(named, flags, strict=True):
        if not isinstance(flag, bool):
            raise TypeError(f"mask for {path!r} is a {type(flag).__name__}, expected a bool")
    return flags


def decay_targets(
    mask: DecayMask, params: PyTree, reference: PyTree, who: str
) -> tuple[list[bool], list[torch.Tensor]]:
    """``(flags, param_leaves)`` for an optimizer that applies weight decay: `resolve_mask`'s flags
    and the leaves of `params`, checked to be shaped like `reference` (the optimizer state's
    per-parameter tree). Raises ``ValueError`` naming `who` if `params` is ``None``."""
    if params is None:
        raise ValueError(f"{who}: weight_decay > 0 needs the params; pass them to update")
    leaves = tensor_leaves_like(params, reference, "params")
    return resolve_mask(mask, params), leaves
