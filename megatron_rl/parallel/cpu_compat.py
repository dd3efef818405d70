"""Run Megatron-core 0.19 on CPU with the gloo backend.

Megatron-core assumes a CUDA device in a handful of places that are not
behind any configuration switch. On a machine without a GPU, :func:`enable`
applies exactly these patches, process-wide and idempotently:

1. ``torch.cuda.current_device`` returns ``torch.device("cpu")`` instead of
   raising. Megatron passes it as a device argument (RoPE frequencies,
   attention masks, p2p receive buffers, TP all-gather outputs and their
   backward buffers, router buffers), also inside autograd backward, where
   the function mode of (2) is not active.
2. A :class:`torch.overrides.TorchFunctionMode` (:class:`_CudaToCpuMode`),
   entered on the thread that calls :func:`enable` (torch modes are
   thread-local: autograd backward and worker threads run without it, hence
   (1)), rewrites every CUDA device argument (``"cuda"``, ``"cuda:N"``,
   ``torch.device("cuda")``, an int ordinal) to ``"cpu"`` in torch calls, and
   makes ``Tensor.cuda()`` return the tensor unchanged and ``pin_memory=True``
   a plain allocation. This covers the ``device="cuda"`` literals (pipeline
   schedules' token counters, the MoE dispatcher's budget flag), the RoPE
   table's context-parallel slice (a pinned index moved with ``.cuda()``)
   and ``.to(torch.cuda.current_device())``. It
   also makes ``Tensor.type()`` (no argument) name CPU tensors as CUDA ones
   (``torch.cuda.FloatTensor``): Megatron's optimizers and gradient clipping
   select fp32 / fp16 parameter groups by comparing these strings.
3. ``torch.cuda.synchronize`` is a no-op (p2p communication, distributed
   checkpoint save).
4. ``torch.cuda.current_stream`` returns :class:`_NullStream`, whose
   ``wait_event`` / ``wait_stream`` / ``synchronize`` do nothing (the DDP grad
   buffer's ``start_grad_sync`` asks for the current stream unconditionally;
   CPU work is synchronous).
5. Megatron's model-parallel RNG tracker is replaced by
   :class:`_CpuRNGStatesTracker`, which forks the CPU generator instead of a
   CUDA generator (Megatron reads and writes CUDA RNG states directly for
   dropout and weight initialisation).
6. Megatron's ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` (activation
   recomputation saves and restores "all" RNG states around each recomputed
   forward) read and write nothing of CUDA: the getter returns the CPU
   generator's state, the setter does nothing (the CPU state is restored
   next to it by ``torch.set_rng_state``); and the backward of Megatron's
   ``CheckpointFunction``, which runs the recomputed forward inside autograd
   backward, runs under the mode of (2) (the ``device="cuda"`` causal mask).

Not patched, avoided by configuration instead (see ``megatron_rl.models``):

- the MoE ``alltoall`` dispatcher creates ``torch.cuda.Stream`` objects, so
  CPU runs use the ``allgather`` dispatcher (which in turn forbids
  ``variable_seq_lengths``);
- Megatron's torch-norm wrapper refuses sequence parallelism, so the local
  spec uses :class:`megatron_rl.models.norm.RMSNorm`;
- ``torch.autocast("cuda", ...)`` in the schedules runs only with an
  ``autocast_dtype``, which our configs never set;
- Megatron's checkpoint writer starts a ``spawn`` multiprocessing Manager
  (slow, not broken); ``mcore_checkpoint`` asks for a forked one.

:func:`enable` refuses to run when CUDA is available: none of this may ever
touch a GPU process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_rl.parallel.device import on_accelerator

PATCHED_ATTRIBUTES: tuple[str, ...] = (
    "torch.cuda.current_device",
    "torch.cuda.synchronize",
    "torch.cuda.current_stream",
    "megatron.core.tensor_parallel.random._CUDA_RNG_STATE_TRACKER",
    "megatron.core.tensor_parallel.random._CUDA_RNG_STATE_TRACKER_INITIALIZED",
    "megatron.core.tensor_parallel.random._get_cuda_rng_state",
    "megatron.core.tensor_parallel.random._set_cuda_rng_state",
    "megatron.core.tensor_parallel.random.CheckpointFunction.backward",
)
"""Attributes that :func:`enable` replaces (besides the global function mode)."""

_state: dict[str, Any] = {"mode": None, "originals": {}}


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrite CUDA device arguments of torch calls to CPU."""

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _cuda_type_name(func(*args))
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False  # pinning needs a CUDA driver
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _cuda_type_name(type_name: str) -> str:
    """``torch.FloatTensor`` -> ``torch.cuda.FloatTensor``; CUDA and other names unchanged."""
    prefix, _, name = type_name.rpartition(".")
    return f"torch.cuda.{name}" if prefix == "torch" else type_name


def _current_device() -> torch.device:
    return torch.device("cpu")


def _synchronize(device: Any = None) -> None:
    return None


class _NullStream:
    """Stands in for the current CUDA stream: CPU execution is already ordered."""

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None


def _current_stream(device: Any = None) -> _NullStream:
    return _NullStream()


def _make_cpu_rng_tracker() -> Any:
    from megatron.core.tensor_parallel.random import _MODEL_PARALLEL_RNG_TRACKER_NAME, CudaRNGStatesTracker

    class _CpuRNGStatesTracker(CudaRNGStatesTracker):
        """Megatron's named RNG states, kept for the CPU generator."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise ValueError(f"RNG seed {seed} is already tracked")
            if name in self.states_:
                raise ValueError(f"RNG state {name!r} is already tracked")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise ValueError(f"RNG state {name!r} was never added (call model_parallel_cuda_manual_seed)")
            outer_state = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer_state)

    return _CpuRNGStatesTracker()


def enable() -> None:
    """Apply the CPU patches listed in the module docstring (idempotent).

    Raises:
        RuntimeError: if CUDA is available; GPU processes must run unpatched.
    """
    if on_accelerator():
        raise RuntimeError("cpu_compat.enable() called on a machine with CUDA; it is CPU-only")
    if is_enabled():
        return
    import megatron.core.tensor_parallel.random as mcore_random

    originals = _state["originals"]
    originals["current_device"] = torch.cuda.current_device
    originals["synchronize"] = torch.cuda.synchronize
    originals["current_stream"] = torch.cuda.current_stream
    originals["tracker"] = mcore_random._CUDA_RNG_STATE_TRACKER
    originals["tracker_initialized"] = mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED
    originals["get_cuda_rng_state"] = mcore_random._get_cuda_rng_state
    originals["set_cuda_rng_state"] = mcore_random._set_cuda_rng_state
    originals["checkpoint_backward"] = vars(mcore_random.CheckpointFunction)["backward"]
    mcore_random._get_cuda_rng_state = _get_cpu_rng_state
    mcore_random._set_cuda_rng_state = _ignore_rng_state
    mcore_random.CheckpointFunction.backward = staticmethod(_recompute_on_cpu)
    # Stand-ins of other types than the stubs say (items 1 and 4 of the module docstring).
    torch.cuda.current_device = _current_device  # type: ignore[assignment]
    torch.cuda.synchronize = _synchronize
    torch.cuda.current_stream = _current_stream  # type: ignore[assignment]
    mcore_random._CUDA_RNG_STATE_TRACKER = _make_cpu_rng_tracker()
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mode = _CudaToCpuMode()
    mode.__enter__()
    _state["mode"] = mode


def disable() -> None:
    """Undo :func:`enable` (used by tests; a no-op when not enabled)."""
    if not is_enabled():
        return
    import megatron.core.tensor_parallel.random as mcore_random

    originals = _state["originals"]
    _state["mode"].__exit__(None, None, None)
    _state["mode"] = None
    torch.cuda.current_device = originals["current_device"]
    torch.cuda.synchronize = originals["synchronize"]
    torch.cuda.current_stream = originals["current_stream"]
    mcore_random._CUDA_RNG_STATE_TRACKER = originals["tracker"]
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = originals["tracker_initialized"]
    mcore_random._get_cuda_rng_state = originals["get_cuda_rng_state"]
    mcore_random._set_cuda_rng_state = originals["set_cuda_rng_state"]
    mcore_random.CheckpointFunction.backward = originals["checkpoint_backward"]


def _recompute_on_cpu(ctx: Any, *grads: torch.Tensor) -> Any:
    with _CudaToCpuMode():
        return _state["originals"]["checkpoint_backward"].__func__(ctx, *grads)


def _get_cpu_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _ignore_rng_state(*args: Any, **kwargs: Any) -> None:
    return None


def is_enabled() -> bool:
    """Whether the CPU patches are currently applied in this process."""
    return _state["mode"] is not None
