"""The tensor transport's reused shared-memory bucket buffers, handed out as tensors to write into.

:class:`BucketBuffers` holds ``num_buffers`` shared-memory buffers (CPU) or device
buffers (CUDA, shared by IPC handle) and fills one
at a time: :meth:`~BucketBuffers.allocate` hands out an empty tensor inside the
buffer being filled (64-byte aligned, bump allocation); :meth:`~BucketBuffers.seal`
takes the tensors of one bucket, checks that every tensor handed out since the
last seal is among them, and moves on to the next buffer, which the next bucket
fills from its start.

Reuse guarantee, given by the caller's order (the tensor transport's): a bucket
is sealed only after the bucket sealed before it (in the other buffer, with two
buffers) has been loaded by the engines. Then the buffer being filled is never
one an engine may still read, and no tensor of a sealed bucket is written again
until that bucket is loaded. A tensor handed out but left out of its bucket
would be sent later from a buffer already being reused, so :meth:`seal` refuses
that. A buffer too small for an allocation is replaced by one of twice its size
(or the allocation's, if larger), starting at offset 0; the tensors already
handed out keep the old buffer alive, and it is never written again. A buffer
smaller than the bucket just sealed in it is replaced there and then by one of
that bucket's size (the sealed bucket keeps the old one alive until it is
loaded), and every sync starts at the first buffer, so a sync that repeats the
previous one's buckets (every sync of a model: same tensors, same order)
allocates no buffer. A buffer holds at most twice the largest bucket. :meth:`~BucketBuffers.release`
drops the buffers but remembers their sizes: the next sync allocates each at the size it had, so a
bucket still fits in one buffer (the tensor transport releases its CUDA buffers after every sync).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from megatron_rl.models.weight_layouts import Shape
from megatron_rl.weight_sync.buckets import NamedTensor

ALIGN_BYTES = 64


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


class BucketBuffers:
    """``num_buffers`` reused buffers on ``device`` (CPU: in shared memory), filled one bucket at a time
    (see the module docstring)."""

    def __init__(self, num_buffers: int = 2, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._buffers: list[torch.Tensor | None] = [None] * num_buffers
        self._capacities = [0] * num_buffers
        self._current = 0
        self._offset = 0
        self._bucket_bytes = 0
        self._handed_out: list[int] = []

    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        self._capacities[self._current] = nbytes
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buffer.share_memory_() if self.device.type == "cpu" else buffer

    def allocate(self, shapes: Sequence[Shape], dtype: torch.dtype) -> list[torch.Tensor]:
        """Empty contiguous tensors of ``shapes`` and ``dtype`` inside the buffer being filled (on :attr:`device`)."""
        return [self._allocate(shape, dtype) for shape in shapes]

    def _allocate(self, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        buffer = self._buffers[self._current]
        if buffer is None or self._offset + nbytes > buffer.numel():
            grown = self._capacities[self._current] if buffer is None else 2 * buffer.numel()
            capacity = max(_aligned(nbytes), grown)
            buffer = self._buffers[self._current] = self._new_buffer(capacity)
            self._offset = 0
        tensor = buffer[self._offset : self._offset + nbytes].view(dtype).view(tuple(shape))
        self._offset += _aligned(nbytes)
        self._bucket_bytes += _aligned(nbytes)
        if nbytes:
            self._handed_out.append(tensor.data_ptr())
        return tensor

    def copy_in(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s values in a tensor allocated here (one copy)."""
        return self._allocate(tuple(tensor.shape), tensor.dtype).copy_(tensor)

    def seal(self, bucket: Sequence[NamedTensor]) -> None:
        """End the bucket being filled; the next allocation starts the next buffer.

        Raises RuntimeError when a tensor handed out since the last seal is not in ``bucket``.
        """
        sent = {tensor.data_ptr() for _, tensor in bucket}
        missing = sum(1 for pointer in self._handed_out if pointer not in sent)
        self._handed_out = []
        if missing:
            raise RuntimeError(
                f"{missing} tensor(s) allocated in a weight-sync bucket buffer are not in the bucket being sent; "
                "every tensor allocated for a bucket must be sent with it (its buffer is reused next)"
            )
        buffer = self._buffers[self._current]
        if buffer is not None and buffer.numel() < self._bucket_bytes:
            self._buffers[self._current] = self._new_buffer(self._bucket_bytes)
        self._current = (self._current + 1) % len(self._buffers)
        self._offset = self._bucket_bytes = 0

    def restart(self) -> None:
        """Forget what was handed out (a new sync, nothing in flight): fill the first buffer from its start."""
        self._handed_out = []
        self._current = self._offset = self._bucket_bytes = 0

    def release(self) -> None:
        """Drop the buffers, keeping their sizes for the next allocations (the tensors handed out keep
        theirs alive until they are dropped)."""
        self._buffers = [None] * len(self._buffers)
        self.restart()
