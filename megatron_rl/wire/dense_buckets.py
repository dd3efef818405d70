"""A bucket as one dense byte buffer: SGLang's ``flattened_bucket`` layout for ``/update_weights_from_distributed``.

With ``load_format="flattened_bucket"`` an SGLang 0.5.23 engine receives a bucket as one
``broadcast`` of a ``uint8`` buffer instead of one per tensor
(``FlattenedTensorBucket.empty`` in ``sglang/srt/weight_sync/tensor_bucket.py``): it lays the
request's tensors out back to back, in request order, with no padding, and refuses a tensor
whose byte offset is not a multiple of its element size ("Unaligned received tensor"). The
sender packs the same layout (:func:`pack`); :func:`aligned_runs` splits a bucket where that
rule would fail (a float32 tensor after an odd number of bfloat16 elements), so every run is
one request and one broadcast. :func:`dense_layout` and :func:`empty_bucket` are the receiver's
side (the reference engine's), with SGLang's checks and messages. Torch only: both sides import it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

NamedTensor = tuple[str, torch.Tensor]


def aligned_runs(bucket: Sequence[NamedTensor]) -> list[list[NamedTensor]]:
    """``bucket`` cut, in order, into the fewest runs whose dense layouts keep every tensor aligned.

    A run ends before a tensor whose offset in the run (the bytes before it) is not a multiple of
    its element size. Uniform dtypes give one run; an empty bucket gives none.
    """
    runs: list[list[NamedTensor]] = []
    offset = 0
    for name, tensor in bucket:
        if not runs or offset % tensor.element_size():
            runs.append([])
            offset = 0
        runs[-1].append((name, tensor))
        offset += tensor.nbytes
    return runs


def pack(run: Sequence[NamedTensor]) -> torch.Tensor:
    """The tensors of ``run`` (one of :func:`aligned_runs`) back to back in a new ``uint8`` tensor on the
    first one's device (one copy of each)."""
    flat = torch.empty(sum(t.nbytes for _, t in run), dtype=torch.uint8, device=run[0][1].device)
    offset = 0
    for _, tensor in run:
        flat[offset : offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        offset += tensor.nbytes
    return flat


def dense_layout(names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]) -> list[int]:
    """Byte offsets of each tensor in the dense layout, plus the total as the last entry.

    Raises ValueError as SGLang's ``FlattenedTensorBucket.empty`` does: for a negative dimension,
    for a tensor whose offset is not a multiple of its element size, and for no tensors at all.
    """
    offsets = [0]
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if any(dim < 0 for dim in shape):
            raise ValueError(f"Negative dimension in received tensor {name}: {torch.Size(shape)}")
        if offsets[-1] % dtype.itemsize:
            raise ValueError(f"Unaligned received tensor {name}: byte offset {offsets[-1]}, dtype {dtype}")
        offsets.append(offsets[-1] + math.prod(shape) * dtype.itemsize)
    if len(offsets) == 1:
        raise ValueError("Cannot create empty tensor bucket")
    return offsets


def empty_bucket(
    names: Sequence[str],
    dtypes: Sequence[torch.dtype],
    shapes: Sequence[Sequence[int]],
    device: torch.device | str,
) -> tuple[torch.Tensor, list[NamedTensor]]:
    """A new ``uint8`` tensor on ``device`` laid out by :func:`dense_layout`, and the named tensors as views
    of it, in order (receive into the flat tensor, read the views), as SGLang's ``FlattenedTensorBucket.empty``
    and ``reconstruct_tensors``. Raises what :func:`dense_layout` raises."""
    offsets = dense_layout(names, dtypes, shapes)
    flat = torch.empty(offsets[-1], dtype=torch.uint8, device=device)
    return flat, [
        (name, flat[start:end].view(dtype).view(tuple(shape)))
        for name, dtype, shape, start, end in zip(names, dtypes, shapes, offsets, offsets[1:], strict=False)
    ]
