"""Run megatron-core's training path when torch has no CUDA device (CPU as a device).

megatron-core assumes CUDA: it seeds and forks CUDA RNG states, allocates buffers with
``device=torch.cuda.current_device()`` or ``'cuda'``, calls ``.cuda()``, asserts
``param.type() == 'torch.cuda.FloatTensor'`` and synchronises grad buffers on CUDA streams.
Over gloo every one of these can be redirected to the CPU without editing megatron-core
(``/work/shared/notes/megatron-on-cpu.md`` lists where each one fails):

- the RNG tracker (``tensor_parallel.random._CUDA_RNG_STATE_TRACKER``) is replaced by
  `CpuRNGStatesTracker`, which forks torch's default CPU generator, and
  ``random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` (used by activation recompute) read and
  write the CPU generator;
- a ``TorchFunctionMode`` rewrites ``device='cuda'`` / ``'cuda:N'`` / ``N`` to the CPU, makes
  ``Tensor.cuda()`` and ``Tensor.pin_memory()`` no-ops, drops ``pin_memory=`` and reports
  ``Tensor.type()`` as ``torch.cuda.*`` and turns ``all_to_all_single``'s split-size tensors
  into lists (the MoE dispatcher moves them to numpy only when they are on CUDA);
- ``torch.cuda.current_device`` / ``current_stream`` / ``default_stream`` / ``Stream`` / ``Event`` /
  ``stream`` / ``synchronize`` / ``empty_cache`` become stubs (CPU work is synchronous, so every
  stream wait is a no-op);
- ``autograd.function.BackwardCFunction.apply`` re-enters the mode: torch leaves a function mode
  while it handles ``backward``, yet megatron's recompute and tensor-parallel Functions run
  their Python backward inside that call.

`enable` refuses to run when CUDA is available: the patch is for CPU-only processes and must
never be active on a GPU. The function mode is thread-local (torch keeps the mode stack per
thread): it covers the thread that called `enable`, which on CPU is also where autograd runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import random as mpu_random
from torch.overrides import TorchFunctionMode

_DEFAULT_RNG = "default-rng"  # megatron's name for "no tracked state is active"
_SPLIT_SIZES = ("output_split_sizes", "input_split_sizes")


class CpuRNGStatesTracker(mpu_random.CudaRNGStatesTracker):
    """megatron-core's RNG tracker on torch's default CPU generator.

    Same methods as ``CudaRNGStatesTracker`` (``reset``, ``get_states``, ``set_states``, ``add``,
    ``fork``, ``is_initialized``); a named state is a CPU generator state (a uint8 tensor), and
    ``fork(name)`` swaps it into the default CPU generator for the duration of the block.
    """

    def add(self, name: str, seed: int) -> None:
        """Track a new state `name` seeded with `seed`.

        Raises ``ValueError`` if the seed or the name is already tracked.
        """
        if seed in self.seeds_:
            raise ValueError(f"rng seed {seed} is already tracked; use a different seed")
        if name in self.states_:
            raise ValueError(f"rng state {name!r} is already tracked; use a different name")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = mpu_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Draw from the tracked state `name` inside the block, then restore the outer state.

        Raises ``ValueError`` if `name` was never added.
        """
        if name not in self.states_:
            raise ValueError(f"rng state {name!r} is not tracked; add(name, seed) it first")
        outer_state, outer_name = torch.get_rng_state(), self._current_state_name
        if outer_name != _DEFAULT_RNG:
            # A fork inside a fork: save the outer stream's progress before switching.
            self.states_[outer_name] = outer_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if outer_name != _DEFAULT_RNG:
                outer_state = self.states_[outer_name]
            torch.set_rng_state(outer_state)
            self._current_state_name = outer_name


def _get_cpu_rng_state(
    device: Any = "cuda", clone: bool = False, graph_safe: bool = False
) -> torch.Tensor:
    """Stands in for ``random._get_cuda_rng_state``: the CPU generator's state (a copy)."""
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """Stands in for ``random._set_cuda_rng_state``: set the CPU generator's state."""
    torch.set_rng_state(new_state)


class _Event:
    """Stands in for ``torch.cuda.Event``: CPU work is done when it is issued."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0


class _Stream:
    """Stands in for ``torch.cuda.Stream``: there is one CPU stream, so waits are no-ops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return _Event() if event is None else event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _cpu_if_cuda(device: Any) -> Any:
    """``torch.device('cpu')`` for a CUDA device spec ('cuda', 'cuda:N', N, device); else as is."""
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.split(":")[0] == "cuda":
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _cpu_tensor_type(spec: Any) -> Any:
    """Map a ``Tensor.type(...)`` target naming a CUDA type to its CPU twin."""
    if isinstance(spec, str):
        return spec.replace("torch.cuda.", "torch.")
    if isinstance(spec, type) and spec.__module__ == "torch.cuda":
        return getattr(torch, spec.__name__)
    return spec


class _CudaToCpuMode(TorchFunctionMode):
    """Runs every torch call on the CPU while reporting CUDA tensor type names."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        kwargs.pop("pin_memory", None)
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        if func is torch.Tensor.to:
            args = (args[0], *(_cpu_if_cuda(a) for a in args[1:]))
        if func is dist.all_to_all_single:
            # The MoE dispatcher turns split sizes into numpy only when they are on CUDA.
            for key in _SPLIT_SIZES:
                if isinstance(kwargs.get(key), torch.Tensor):
                    kwargs[key] = kwargs[key].tolist()
        if func is torch.Tensor.type:
            if len(args) == 1 and "dtype" not in kwargs:
                name = func(*args, **kwargs)
                # megatron asserts grads/params are 'torch.cuda.FloatTensor' and friends.
                return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
            args = (args[0], *(_cpu_tensor_type(a) for a in args[1:]))
            if "dtype" in kwargs:
                kwargs["dtype"] = _cpu_tensor_type(kwargs["dtype"])
        return func(*args, **kwargs)


@dataclasses.dataclass
class _Patch:
    """What `disable` needs to undo `enable`: replaced attributes and the active mode."""

    saved: list[tuple[object, str, object]] = dataclasses.field(default_factory=list)
    mode: _CudaToCpuMode | None = None


_PATCH = _Patch()


def _backward_in_mode(apply: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``BackwardCFunction.apply`` so custom Functions' backward runs inside the mode.

    torch pops a function mode while it handles a call, and the autograd engine runs inside the
    handled ``backward`` call: without this, megatron's recompute (which re-runs the forward) and
    its tensor-parallel Functions would see raw ``'cuda'`` devices during backward.
    """

    def apply_in_mode(self: Any, *args: Any) -> Any:
        mode = _PATCH.mode
        if mode is None or mode in torch.overrides._get_current_function_mode_stack():
            return apply(self, *args)
        with mode:
            return apply(self, *args)

    return apply_in_mode


def _replacements() -> list[tuple[object, str, object]]:
    stream = _Stream()
    backward_cls = torch.autograd.function.BackwardCFunction

    def current_stream(device: Any = None) -> _Stream:
        return stream

    def no_op(*args: Any, **kwargs: Any) -> None:
        return None

    def current_device() -> int:
        return 0

    def stream_context(stream: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    cuda: list[tuple[str, Callable[..., Any] | type]] = [
        ("current_device", current_device),
        ("current_stream", current_stream),
        ("default_stream", current_stream),
        ("Stream", _Stream),
        ("Event", _Event),
        ("stream", stream_context),
        ("synchronize", no_op),
        ("empty_cache", no_op),
    ]
    return [
        (mpu_random, "_CUDA_RNG_STATE_TRACKER", CpuRNGStatesTracker()),
        (mpu_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True),
        (mpu_random, "_get_cuda_rng_state", _get_cpu_rng_state),
        (mpu_random, "_set_cuda_rng_state", _set_cpu_rng_state),
        *((torch.cuda, name, value) for name, value in cuda),
        (backward_cls, "apply", _backward_in_mode(backward_cls.apply)),
    ]


def is_enabled() -> bool:
    """Whether the CPU compatibility patch is active."""
    return _PATCH.mode is not None


def enable() -> None:
    """Redirect megatron-core's CUDA calls to the CPU; a no-op if already enabled.

    Call it before building a model or calling ``model_parallel_cuda_manual_seed``. Raises
    ``RuntimeError`` if ``torch.cuda.is_available()``: the patch must never be active on a GPU.
    """
    if torch.cuda.is_available():
        raise RuntimeError(
            "twinkle_fn.backends.megatron.cpu_compat must never be active on a GPU, but torch sees a "
            "CUDA device; run megatron-core on the GPU without enabling it"
        )
    if is_enabled():
        return
    for owner, name, value in _replacements():
        _PATCH.saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)
    mode = _CudaToCpuMode()
    mode.__enter__()
    _PATCH.mode = mode


def disable() -> None:
    """Undo `enable`: restore every replaced attribute and leave the function mode.

    A no-op if not enabled. Raises ``RuntimeError`` if another ``TorchFunctionMode`` entered
    after `enable` is still active (modes must be left in reverse order).
    """
    mode = _PATCH.mode
    if mode is None:
        return
    if torch.overrides._get_current_function_mode() is not mode:
        raise RuntimeError(
            "a TorchFunctionMode entered after cpu_compat.enable() is still active; "
            "exit it before calling cpu_compat.disable()"
        )
    mode.__exit__(None, None, None)
    _PATCH.mode = None
    while _PATCH.saved:
        owner, name, value = _PATCH.saved.pop()
        setattr(owner, name, value)


@contextlib.contextmanager
def cpu_mode() -> Iterator[None]:
    """`enable` for the duration of a block; disables on exit only if this block enabled it.

    Raises ``RuntimeError`` if CUDA is available (see `enable`).
    """
    owner = not is_enabled()
    enable()
    try:
        yield
    finally:
        if owner:
            disable()
