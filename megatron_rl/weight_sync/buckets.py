"""Group a stream of named tensors into fixed-size buckets without holding more than one bucket.

A bucket is a list of ``(hf_name, tensor)`` whose sizes add up to at most
``bucket_bytes``; a single tensor larger than that is a bucket of its own.
:class:`BucketFiller` hands each bucket on as soon as it is full (order kept),
so the exporter's per-layer gathers and the transport's sends interleave and
peak memory is about one bucket plus one layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from megatron_rl.models.weight_layouts import Shape
from megatron_rl.models.weight_transfer import Allocate

NamedTensor = tuple[str, torch.Tensor]

MIB = 1 << 20


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's elements (``numel * element_size``)."""
    return tensor.numel() * tensor.element_size()


class BucketFiller:
    """Fills buckets of at most ``bucket_bytes`` and calls ``send`` with each, in stream order.

    Tensors come in two ways. :meth:`add` takes a tensor made elsewhere. :meth:`allocate`
    (when the transport hands out bucket memory, ``transport_allocate``) gives the caller
    empty tensors in the bucket being filled (one call per group that belongs together, e.g.
    a parameter's q, k and v), to write and then :meth:`add`; a group that does not fit sends
    the bucket first, so the caller must have added every tensor it allocated before it
    allocates again (the transport refuses a bucket that lacks one). Both count a tensor
    once, by the same rule: a bucket is sent when the next tensor (or allocated group) would
    take it past ``bucket_bytes``. Raises ValueError when ``bucket_bytes`` < 1.
    """

    def __init__(
        self,
        bucket_bytes: int,
        send: Callable[[list[NamedTensor]], None],
        transport_allocate: Allocate | None = None,
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self._send = send
        self._transport_allocate = transport_allocate
        self._bucket: list[NamedTensor] = []
        self._size = 0
        self._allocated: set[int] = set()

    @property
    def allocate(self) -> Allocate | None:
        """Bucket memory for the caller to write a tensor into, or None when the transport has none."""
        return None if self._transport_allocate is None else self._allocate

    def _allocate(self, shapes: Sequence[Shape], dtype: torch.dtype) -> list[torch.Tensor]:
        assert self._transport_allocate is not None
        self._make_room(sum(math.prod(shape) for shape in shapes) * dtype.itemsize)
        tensors = self._transport_allocate(shapes, dtype)
        for tensor in tensors:
            if tensor.numel():
                self._size += tensor_bytes(tensor)
                self._allocated.add(tensor.data_ptr())
        return tensors

    def _make_room(self, nbytes: int) -> None:
        if (self._bucket or self._allocated) and self._size + nbytes > self.bucket_bytes:
            self.flush()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Put ``tensor`` into the bucket being filled (sending the bucket first when it would overflow)."""
        if tensor.numel() and tensor.data_ptr() in self._allocated:
            self._allocated.discard(tensor.data_ptr())
        else:
            self._make_room(tensor_bytes(tensor))
            self._size += tensor_bytes(tensor)
        self._bucket.append((name, tensor))

    def flush(self) -> None:
        """Send the bucket being filled, if it holds anything."""
        bucket, self._bucket, self._size, self._allocated = self._bucket, [], 0, set()
        if bucket:
            self._send(bucket)
