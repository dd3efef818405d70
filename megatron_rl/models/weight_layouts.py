"""How one Megatron parameter shard relates to its Hugging Face tensors.

Each layout answers these questions for a parameter split over a tensor-parallel
group of ``size`` ranks:

- ``hf_shapes(local_shape, size)``: the full Hugging Face shapes it corresponds to
  (used to validate a checkpoint before reading it);
- ``read_shard(read, names, rank, local_shape)``: build rank ``rank``'s shard
  (of shape ``local_shape``), reading only the rows/columns it owns through
  ``read(name, rows, cols)``;
- ``gather_targets(out, local_shape, size)``: where in ``out`` the shards lie
  unchanged, if they do (an unpadded vocabulary's row blocks), so a gather can
  receive them there and skip ``unshard``;
- ``unshard(shards, out)``: given all ranks' shards (rank order), return the full
  Hugging Face tensors, one per name. With ``out`` (one tensor per name, of the
  ``hf_shapes``), the values are written into those tensors and they are returned
  (e.g. a transport's shared-memory bucket); without, a single shard is returned
  as views of itself wherever the layout is a plain slice of it (no copy), and
  several shards are concatenated into new tensors. Either way the values are
  the same, bit for bit.

Legend: H hidden, d head_dim, g query groups (KV heads), q query heads per
group, I intermediate size, V vocab, Vp padded vocab.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

Shape = tuple[int, ...]


class SliceReader(Protocol):
    """Reads ``tensor[rows, cols]`` of a named Hugging Face tensor (None: all)."""

    def __call__(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor: ...


class Layout(Protocol):
    """Sharding of one Megatron parameter relative to its Hugging Face tensors."""

    tensor_parallel: bool

    def hf_shapes(self, local_shape: Shape, size: int) -> list[Shape]: ...

    def read_shard(self, read: SliceReader, names: Sequence[str], rank: int, local_shape: Shape) -> torch.Tensor: ...

    def unshard(
        self, shards: Sequence[torch.Tensor], out: Sequence[torch.Tensor] | None = None
    ) -> list[torch.Tensor]: ...

    def gather_targets(self, out: Sequence[torch.Tensor], local_shape: Shape, size: int) -> list[torch.Tensor] | None:
        """Views of ``out`` (the full tensors) that the ``size`` ranks' shards of ``local_shape`` are, unchanged,
        when the full tensors are just the shards one after the other (a gather can then write them in place);
        else None."""
        ...


def _block(rank: int, length: int) -> slice:
    return slice(rank * length, (rank + 1) * length)


def _concat(parts: Sequence[torch.Tensor], dim: int, out: torch.Tensor | None) -> torch.Tensor:
    """``parts`` concatenated along ``dim``: written into ``out`` when given, else one part as itself (no copy)."""
    if out is not None:
        return torch.cat(list(parts), dim=dim, out=out)
    return parts[0] if len(parts) == 1 else torch.cat(list(parts), dim=dim)


def _out(out: Sequence[torch.Tensor] | None, index: int) -> torch.Tensor | None:
    return None if out is None else out[index]


class Replicated:
    """Same full tensor on every rank (norms, router)."""

    tensor_parallel = False

    def hf_shapes(self, local_shape: Shape, size: int) -> list[Shape]:
        return [local_shape]

    def read_shard(self, read: SliceReader, names: Sequence[str], rank: int, local_shape: Shape) -> torch.Tensor:
        return read(names[0])

    def unshard(self, shards: Sequence[torch.Tensor], out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        return [_concat(shards[:1], 0, _out(out, 0))]

    def gather_targets(self, out: Sequence[torch.Tensor], local_shape: Shape, size: int) -> list[torch.Tensor] | None:
        return None


class RowParallel:
    """Split along the input dimension (dim 1): ``linear_proj``, ``linear_fc2``."""

    tensor_parallel = True

    def hf_shapes(self, local_shape: Shape, size: int) -> list[Shape]:
        return [(local_shape[0], local_shape[1] * size)]

    def read_shard(self, read: SliceReader, names: Sequence[str], rank: int, local_shape: Shape) -> torch.Tensor:
        return read(names[0], cols=_block(rank, local_shape[1]))

    def unshard(self, shards: Sequence[torch.Tensor], out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        return [_concat(shards, 1, _out(out, 0))]

    def gather_targets(self, out: Sequence[torch.Tensor], local_shape: Shape, size: int) -> list[torch.Tensor] | None:
        return None


@dataclass(frozen=True)
class VocabParallel:
    """Rows of a ``[Vp, H]`` table split over ranks; rows >= V are padding (zeros on import)."""

    vocab_size: int
    tensor_parallel = True

    def hf_shapes(self, local_shape: Shape, size: int) -> list[Shape]:
        return [(self.vocab_size, local_shape[1])]

    def read_shard(self, read: SliceReader, names: Sequence[str], rank: int, local_shape: Shape) -> torch.Tensor:
        rows = local_shape[0]
        start, stop = rank * rows, min((rank + 1) * rows, self.vocab_size)
        real = read(names[0], rows=slice(start, max(start, stop)))
        padding = real.new_zeros((rows - real.shape[0], real.shape[1]))
        return torch.cat([real, padding], dim=0)

    def unshard(self, shards: Sequence[torch.Tensor], out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        if out is None and len(shards) == 1:
            return [shards[0][: self.vocab_size]]
        full = out[0] if out is not None else shards[0].new_empty((self.vocab_size, shards[0].shape[1]))
        start = 0
        for shard in shards:
            rows = min(shard.shape[0], self.vocab_size - start)
            full[start : start + rows].copy_(shard[:rows])
            start += rows
        return [full]

    def gather_targets(self, out: Sequence[torch.Tensor], local_shape: Shape, size: int) -> list[torch.Tensor] | None:
        """Row blocks of the table when no row is padding (the padded vocabulary is the vocabulary)."""
        rows = local_shape[0]
        return list(out[0].split(rows, dim=0)) if rows * size == self.vocab_size else None


@dataclass(frozen=True)
class FusedQKV:
    """``linear_qkv`` ``[g*(q+2)*d, H]``: per KV group, its q heads then k then v.

    Hugging Face names: q_proj ``[g*q*d, H]``, k_proj and v_proj ``[g*d, H]``.
    A TP rank holds ``g / size`` whole groups.
    """

    num_heads: int
    num_groups: int
    head_dim: int
    tensor_parallel = True

    @property
    def _q_per_group(self) -> int:
        return self.num_heads // self.num_groups

    def hf_shapes(self, local_shape: Shape, size: int) -> list[Shape]:
        hidden, d = local_shape[1], self.head_dim
        return [(self.num_heads * d, hidden), (self.num_groups * d, hidden), (self.num_groups * d, hidden)]

    def read_shard(self, read: SliceReader, names: Sequence[str], rank: int, local_shape: Shape) -> torch.Tensor:
        d, q = self.head_dim, self._q_per_group
        groups = local_shape[0] // ((q + 2) * d)
        query = read(names[0], rows=_block(rank, groups * q * d))
        key = read(names[1], rows=_block(rank, groups * d))
        value = read(names[2], rows=_block(rank, groups * d))
        hidden = query.shape[1]
        parts = [query.view(groups, q * d, hidden), key.view(groups, d, hidden), value.view(groups, d, hidden)]
        return torch.cat(parts, dim=1).reshape(-1, hidden)

    def unshard(self, shards: Sequence[torch.Tensor], out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Each shard's groups are copied straight into the q, k and v tensors (always a copy: they interleave)."""
        hidden, q, d = shards[0].shape[1], self._q_per_group, self.head_dim
        if out is None:
            out = [shards[0].new_empty(shape) for shape in self.hf_shapes(tuple(shards[0].shape), len(shards))]
        query = out[0].view(self.num_groups, q, d, hidden)
        key, value = (tensor.view(self.num_groups, d, hidden) for tensor in out[1:])
        start = 0
        for shard in shards:
            grouped = shard.reshape(-1, q + 2, d, hidden)
            stop = start + grouped.shape[0]
            query[start:stop].copy_(grouped[:, :q])
            key[start:stop].copy_(grouped[:, q])
            value[start:stop].copy_(grouped[:, q + 1])
            start = stop
        return list(out)

    def gather_targets(self, out: Sequence[torch.Tensor], local_shape: Shape, size: int) -> list[torch.Tensor] | None:
        return None


class FusedGateUp:
    """``linear_fc1`` ``[2*I/size, H]`` per rank: ``[gate rows of the rank; up rows of the rank]``."""

    tensor_parallel = True

    def hf_shapes(self, local_shape: Shape, size: int) -> list[Shape]:
        full = (local_shape[0] // 2 * size, local_shape[1])
        return [full, full]

    def read_shard(self, read: SliceReader, names: Sequence[str], rank: int, local_shape: Shape) -> torch.Tensor:
        rows = _block(rank, local_shape[0] // 2)
        gate, up = read(names[0], rows=rows), read(names[1], rows=rows)
        return torch.cat([gate, up], dim=0)

    def unshard(self, shards: Sequence[torch.Tensor], out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return [_concat([h[half] for h in halves], 0, _out(out, half)) for half in (0, 1)]

    def gather_targets(self, out: Sequence[torch.Tensor], local_shape: Shape, size: int) -> list[torch.Tensor] | None:
        return None
