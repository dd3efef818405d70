"""Group a stream of named tensors into fixed-size buckets without holding more than one bucket.

A bucket is a list of ``(hf_name, tensor)`` whose sizes add up to at most
``bucket_bytes``; a single tensor larger than that is a bucket of its own.
Tensors are yielded as the stream produces them (order kept), so the
exporter's per-layer gathers and the transport's sends interleave and peak
memory is about one bucket plus one layer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

NamedTensor = tuple[str, torch.Tensor]

MIB = 1 << 20


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's elements (``numel * element_size``)."""
    return tensor.numel() * tensor.element_size()


def iter_buckets(named_tensors: Iterable[NamedTensor], bucket_bytes: int) -> Iterator[list[NamedTensor]]:
    """Yield consecutive buckets of at most ``bucket_bytes`` (ValueError when it is < 1)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: list[NamedTensor] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor_bytes(tensor)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
