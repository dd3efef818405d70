"""Free the actor's device memory between training phases, and bring it back unchanged.

Colocated mode runs rollout engines on the trainer's GPUs, so during
generation the actor gives back the memory of its parameters, gradients and
optimizer state. :class:`StateOffloader` does it on the storages underneath
(Megatron's DDP param/grad buffers, the parameters outside them, the optimizer's
master weights and Adam moments): each distinct storage is copied to host memory (pinned on GPU) and
resized to zero bytes; reload resizes it and copies the bytes back. Every
tensor and view keeps pointing at the same storage, so Megatron's buffers,
bucket views and optimizer shards stay valid, and the round trip is
bit-identical. On CPU the same calls run (the "device" is host memory), which
is what the tests pin.

DDP's buffers hold only parameters that require gradients; the frozen ones (the base
model under LoRA) keep their own storages and count as parameters here.

``extra`` tensors (the reference weights when they live on the device) are
offloaded with the optimizer state.

``offload(keep_params=True)`` frees only the gradient buffers and the
optimizer's own storages (Adam moments, fp32 master copies) and ``extra``, keeping the
parameter buffers: weight sync can still read the parameters while the
engines' weights come back. A later ``offload()`` frees the rest; ``reload``
restores whatever was offloaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from megatron.core.optimizer import MegatronOptimizer

from megatron_rl.parallel.device import on_accelerator

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel


def _buffer_tensors(models: Sequence[DistributedDataParallel], attribute: str) -> list[torch.Tensor]:
    tensors = []
    for model in models:
        for buffer in [*model.buffers, *model.expert_parallel_buffers]:
            tensor = getattr(buffer, attribute, None)
            if tensor is not None:
                tensors.append(tensor)
    return tensors


def _frozen_parameters(models: Sequence[DistributedDataParallel]) -> list[torch.Tensor]:
    """The parameters DDP left out of its buffers: those that require no gradient."""
    return [param for model in models for param in model.parameters() if not param.requires_grad]


def _optimizer_tensors(optimizer: MegatronOptimizer) -> list[torch.Tensor]:
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    tensors = []
    for megatron_optimizer in inner:
        torch_optimizer = megatron_optimizer.optimizer
        if torch_optimizer is None:  # a stub part, which has no parameters (LoRA on experts only, at EP > 1)
            continue
        for group in torch_optimizer.param_groups:
            tensors.extend(group["params"])
        for state in torch_optimizer.state.values():
            tensors.extend(value for value in state.values() if isinstance(value, torch.Tensor))
    return tensors


class StateOffloader:
    """Offloads and reloads the storages of parameters, gradients and optimizer state."""

    def __init__(
        self,
        models: Sequence[DistributedDataParallel],
        optimizer: MegatronOptimizer,
        extra: Sequence[torch.Tensor] = (),
    ) -> None:
        self._models = list(models)
        self._optimizer = optimizer
        self._extra = list(extra)
        self._saved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    @property
    def offloaded(self) -> bool:
        """Whether any state is currently in host memory."""
        return bool(self._saved)

    def offload(self, *, keep_params: bool = False) -> None:
        """Copy state storages to host memory and free them on the device; storages already offloaded are skipped.

        ``keep_params``: keep the parameter buffers (and optimizer tensors sharing their storage) on the device.
        """
        params = [*_buffer_tensors(self._models, "param_data"), *_frozen_parameters(self._models)]
        kept = {storage.data_ptr() for storage in _distinct_storages(params)} if keep_params else set()
        tensors = [
            *([] if keep_params else params),
            *_buffer_tensors(self._models, "grad_data"),
            *_optimizer_tensors(self._optimizer),
            *self._extra,
        ]
        for storage in _distinct_storages(tensors):
            if storage.data_ptr() in kept:
                continue
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
            host.untyped_storage().copy_(storage)
            storage.resize_(0)
            self._saved.append((storage, host))
        if on_accelerator():
            torch.cuda.empty_cache()

    def reload(self) -> None:
        """Restore every offloaded storage, bit for bit (no-op if not offloaded)."""
        for storage, host in self._saved:
            storage.resize_(host.numel())
            storage.copy_(host.untyped_storage())
        self._saved = []


def _distinct_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    storages: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() > 0:
            storages.setdefault(storage.data_ptr(), storage)
    return list(storages.values())
