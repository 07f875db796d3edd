"""The model option ``fp8`` on the transformers backend: decoder linears with float8 GEMMs.

`use_fp8_linears` turns the decoder layers' linears that the family's row lists (its tensor-
parallel plan and ``tp_whole``: the attention's q/k/v/o, the dense and shared-expert MLPs'; not
the embedding, the lm_head, a router or a shared-expert gate) into `FP8Linear`, an
``nn.Linear`` whose forward is `twinkle_fn.backends.fp8.fp8_linear` (recipes, numerics and
requirements there). Under LoRA those are the frozen base linears (peft's ``base_layer``): their
forward and input-gradient GEMMs, most of a LoRA step's work, run in float8 (there is no weight
gradient to compute), while the adapters' factors, too small for float8 GEMMs to pay, keep the
compute dtype.

The conversion is a class swap before tensor parallelism, ``compile_layers`` and FSDP2 wrap the
layers, so all three see an ``nn.Linear``: FSDP2 gathers the weight as before (the forward
sees it whole, in the compute dtype); under tp the weight is a DTensor shard, and `FP8Linear`
multiplies the local shards and returns the DTensor that ``F.linear`` would (a colwise output
split over features, a rowwise output partial), which the parallel styles then reduce as usual.

``fp8_store_frozen=True`` (with ``fp8``) stores each converted linear's frozen weight (a LoRA
base) in float8 (`twinkle_fn.backends.fp8.store_weight`: e4m3 and one power-of-two scale, the
non-persistent buffer ``fp8_weight_scale``): one byte an element instead of two, and no step
quantises it again; the tensorwise recipe's numbers are unchanged, bit for bit. Checkpoints and
exports read it back dequantised (`dense_state`), exactly; a checkpoint loads into it through
`load_stored`. Each rank keeps such a weight whole (FSDP2 leaves float8 parameters unsharded,
`twinkle_fn.backends.transformers.fsdp.parallelize`: at one byte an element, a replica costs
what a bf16 shard over two ranks does, and the forward gathers nothing), so tp, which splits
it, refuses the option.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from twinkle_fn.backends.fp8 import (
    E4M3,
    check_device,
    check_linear,
    check_setting,
    check_store_setting,
    dequantise,
    fp8_linear,
    store_weight,
)
from twinkle_fn.backends.transformers.plans import tp_plan
from twinkle_fn.mesh import Mesh
from twinkle_fn.models.families import COLWISE, family
from twinkle_fn.models.model import Model


class FP8Linear(torch.nn.Linear):
    """``nn.Linear`` computing ``x @ w.T + b`` with float8 GEMMs (`fp8_linear`; a frozen weight
    gets no weight gradient); ``fp8_recipe``: one of `twinkle_fn.backends.fp8.RECIPES`. `x`
    ``[..., in]`` -> ``[..., out]``."""

    fp8_recipe: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class."""
        w = self.weight
        if isinstance(w, DTensor):
            return _dtensor_linear(x, w, self.bias, self.fp8_recipe)
        scale = self.fp8_weight_scale if w.dtype == E4M3 else None
        return fp8_linear(x, w, self.bias, self.fp8_recipe, scale)


def _dtensor_linear(
    x: torch.Tensor, w: DTensor, bias: torch.Tensor | None, recipe: str
) -> torch.Tensor:
    """`fp8_linear` of the local shards of `x` (a DTensor under tp's input styles) and `w`,
    returned as the DTensor ``F.linear`` gives: the weight split on dim 0 (colwise) gives an
    output split on its last dim, split on dim 1 (rowwise, `x` split on its last dim) a partial
    sum; the bias is added as a DTensor, so a rowwise bias is added once, after the reduction."""
    (placement,) = w.placements
    x_local = x.to_local() if isinstance(x, DTensor) else x
    out = fp8_linear(x_local, w.to_local(), None, recipe)
    if placement == Shard(0):
        layout = Shard(out.ndim - 1)
    elif placement == Shard(1):
        layout = Partial()
    else:
        layout = x.placements[0] if isinstance(x, DTensor) else Replicate()
    result = DTensor.from_local(out, w.device_mesh, (layout,), run_check=False)
    return result if bias is None else result + bias


def use_fp8_linears(model: Model, mesh: Mesh) -> int:
    """Apply the model option ``fp8`` (see the module docstring) to `model`'s decoder layers,
    before they are parallelised; returns how many linears became `FP8Linear` (0 with the
    option off).

    Raises ``ValueError`` for an unknown recipe, a device without float8 GEMMs
    (`twinkle_fn.backends.fp8.check_device`), a converted linear whose dimensions on this rank
    (after tp) are not multiples of 16 (`check_linear`, naming it), ``fp8_store_frozen`` without
    ``fp8``, not a bool, or on several ranks.
    """
    recipe = check_setting(model.options.get("fp8"))
    store = _store_frozen(model, mesh)
    if recipe is None:
        return 0
    check_device(model.device)
    subs = {**tp_plan(model.config, mesh.tp), **dict.fromkeys(family(model.config).tp_whole)}
    names = {id(m): n for n, m in model.module.named_modules()}
    linears = []
    for layer in model.module.get_decoder().layers:
        for sub, style in subs.items():
            linear = _submodule(layer, sub)
            linear = getattr(linear, "base_layer", linear)  # peft's LoRA wraps the linear
            if type(linear) is not torch.nn.Linear:
                continue  # absent in this layer
            out_f, in_f = linear.out_features, linear.in_features
            if style is not None and mesh.tp > 1:
                out_f, in_f = (
                    (out_f // mesh.tp, in_f) if style == COLWISE else (out_f, in_f // mesh.tp)
                )
            split = f" on each of tp={mesh.tp} ranks" if style is not None and mesh.tp > 1 else ""
            check_linear(names[id(linear)], out_f, in_f, split)
            linears.append(linear)
    for linear in linears:
        linear.__class__ = FP8Linear
        linear.fp8_recipe = recipe
        if store and not linear.weight.requires_grad:
            wq, scale = store_weight(linear.weight.detach())
            linear.weight = torch.nn.Parameter(wq, requires_grad=False)
            linear.register_buffer("fp8_weight_scale", scale, persistent=False)
    return len(linears)


def _store_frozen(model: Model, mesh: Mesh) -> bool:
    """The option ``fp8_store_frozen`` (off by default). Raises ``ValueError`` as
    `twinkle_fn.backends.fp8.check_store_setting` does, and under tensor parallelism (which
    would split a weight that is one float8 tensor with one scale)."""
    value = check_store_setting(model.options)
    if value and mesh.tp > 1:
        raise ValueError(
            f"option fp8_store_frozen=True keeps each stored weight whole on every rank, but "
            f"tp={mesh.tp} splits the linears; leave it off with tp (fp8 alone works there)"
        )
    return value


def stored_scales(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights of `module` stored in float8 (``fp8_store_frozen``), by parameter name: the
    scale of each."""
    return {
        f"{name}.weight" if name else "weight": m.fp8_weight_scale
        for name, m in module.named_modules()
        if isinstance(m, FP8Linear) and m.weight.dtype == E4M3
    }


def dense_state(
    module: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`named` (``(name, tensor)`` pairs, parameter names of `module`) one at a time, each
    weight stored in float8 dequantised to float32, exactly
    (`twinkle_fn.backends.fp8.dequantise`); the rest as they are."""
    scales = stored_scales(module)
    for name, t in named:
        yield name, dequantise(t.detach(), scales[name]) if name in scales else t


def load_stored(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Store `tensor` into `module`'s parameter `name` if that weight is stored in float8
    (quantised again, with a new scale; a weight `dense_state` gave back stores bit for bit as
    it was) and return True; else leave it and return False."""
    owner, _, leaf = name.rpartition(".")
    linear = module.get_submodule(owner)
    if leaf != "weight" or not isinstance(linear, FP8Linear) or linear.weight.dtype != E4M3:
        return False
    wq, scale = store_weight(tensor.to(linear.weight.device))
    with torch.no_grad():
        linear.weight.copy_(wq)
        linear.fp8_weight_scale.copy_(scale)
    return True


def _submodule(module: torch.nn.Module, sub: str) -> torch.nn.Module | None:
    """`module`'s submodule at the dotted path `sub`, None where this layer has none (a plan
    entry of another kind of layer)."""
    try:
        return module.get_submodule(sub)
    except AttributeError:
        return None
