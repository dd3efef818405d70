"""Keeps the senders' shared-memory buffers mapped between weight updates (CPU tensor transport).

A sender packs every bucket into the same few shared-memory buffers, or sends weights that
already live in shared memory in place
(:class:`~megatron_rl.weight_sync.transports.TensorTransport`): either way each sync sends
views of the same storages. Opening one maps its file again and touches every page anew,
which costs more than copying the bucket out (measured on the 2-core box: about 3x). Torch
reuses an open mapping for a handle while the storage is alive, so holding the storages
makes every later bucket from the same storage open at no cost.

Held: the CPU storages received in the sync in progress and in the last one that ended.
At the end of a sync, buffers it did not use are let go, so a buffer the sender replaced
(grown, or closed) stays mapped until the end of the next sync at most. The memory is the
sender's: holding it allocates nothing. CUDA tensors are never held (an open CUDA IPC
handle would pin the trainer's memory after it is freed or offloaded).
"""

from __future__ import annotations

import torch


class SharedBufferMappings:
    """The shared-memory storages received over recent syncs, by data pointer."""

    def __init__(self) -> None:
        self._held: dict[int, torch.UntypedStorage] = {}
        self._used: set[int] = set()

    def hold(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Keep the storage of every CPU tensor in ``named_tensors`` mapped."""
        for _, tensor in named_tensors:
            if tensor.device.type != "cpu":
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            self._held[key] = storage
            self._used.add(key)

    def end_sync(self) -> None:
        """Let go of the buffers the sync just ended did not use."""
        self._held = {key: storage for key, storage in self._held.items() if key in self._used}
        self._used = set()

    def __len__(self) -> int:
        return len(self._held)
