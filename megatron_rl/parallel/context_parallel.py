"""Context parallelism's load-balanced sequence split, and the gathers that undo it.

Megatron's layout (``get_batch_on_this_cp_rank``, the RoPE table's
``get_pos_emb_on_this_cp_rank`` and Transformer Engine's causal CP attention all
assume it): a sequence of S positions is cut into ``2 * cp`` equal chunks and CP rank
r holds chunks r and ``2 * cp - 1 - r``, in that order, so every rank gets as much
causal-attention work. S must be a multiple of ``2 * cp``. A packed stream of
sequences (THD) is split the same way sequence by sequence (``segments``: its
boundaries ``0 = c_0 < ... < c_n = T``, each sequence a multiple of ``2 * cp``), as
Transformer Engine's ``thd_get_partitioned_indices`` does: rank r's stream is every
sequence's chunks r and ``2 * cp - 1 - r``, sequence after sequence.

:func:`gather_sequence` puts the ranks' local pieces back into the sequence's order.
Its backward says who owns the gradient:

* ``grads="sum"``: every rank's result depends on every rank's piece (keys and values
  in attention): the full gradient is summed over the CP ranks, then each keeps its
  own positions;
* ``grads="own"``: every rank computes the same function of the gathered tensor (the
  loss of whole rows): each rank's gradient for its own positions is already the
  whole gradient there, so it keeps those and drops the rest, with no communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

GradOwnership = Literal["sum", "own"]


def local_positions(
    seq_length: int,
    cp: int,
    rank: int,
    device: torch.device | str = "cpu",
    *,
    segments: Sequence[int] | None = None,
) -> torch.Tensor:
    """[S / cp] int64: the positions CP ``rank`` of ``cp`` holds, in its local order.

    ``segments``: the boundaries of the packed sequences (``segments[-1] == seq_length``), each
    split on its own; None: one sequence.

    Raises:
        ValueError: a sequence is not a positive multiple of ``2 * cp`` tokens, the segments do not
            end at ``seq_length``, or ``rank`` is outside ``[0, cp)``.
    """
    bounds = list(segments) if segments is not None else [0, seq_length]
    if bounds[0] != 0 or bounds[-1] != seq_length:
        raise ValueError(f"segments {bounds} must run from 0 to the sequence length {seq_length}")
    if not 0 <= rank < cp:
        raise ValueError(f"CP rank {rank} is outside [0, {cp})")
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end <= start or (end - start) % (2 * cp):
            raise ValueError(
                f"a sequence split over {cp} CP ranks needs a multiple of 2*cp={2 * cp} tokens; got {end - start}"
            )
        chunk = (end - start) // (2 * cp)
        for first in (start + rank * chunk, start + (2 * cp - 1 - rank) * chunk):
            pieces.append(torch.arange(first, first + chunk, device=device))
    return torch.cat(pieces)


def split_sequence(
    tensor: torch.Tensor, dim: int, group: dist.ProcessGroup, *, segments: Sequence[int] | None = None
) -> torch.Tensor:
    """This CP rank's positions of ``tensor`` along ``dim`` (see :func:`local_positions`)."""
    positions = local_positions(tensor.shape[dim], group.size(), group.rank(), tensor.device, segments=segments)
    return tensor.index_select(dim, positions)


def gather_sequence(
    local: torch.Tensor,
    dim: int,
    group: dist.ProcessGroup,
    grads: GradOwnership,
    *,
    segments: Sequence[int] | None = None,
) -> torch.Tensor:
    """The whole sequence along ``dim`` from every CP rank's ``local`` piece; differentiable (see the module doc)."""
    result: torch.Tensor = _GatherSequence.apply(local, dim, group, grads, segments)
    return result


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        local: torch.Tensor,
        dim: int,
        group: dist.ProcessGroup,
        grads: GradOwnership,
        segments: Sequence[int] | None,
    ) -> Any:
        cp = group.size()
        pieces = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(pieces, local.contiguous(), group=group)
        gathered = torch.cat(pieces, dim=dim)
        length = gathered.shape[dim]
        # Where each gathered element (the ranks' pieces, rank after rank) sits in the sequence.
        order = torch.cat([local_positions(length, cp, rank, local.device, segments=segments) for rank in range(cp)])
        ctx.dim, ctx.group, ctx.grads, ctx.segments = dim, group, grads, segments
        return torch.empty_like(gathered).index_copy_(dim, order, gathered)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        if ctx.grads == "sum":
            grad = grad.clone(memory_format=torch.contiguous_format)  # reduced in place; autograd may hold the input
            dist.all_reduce(grad, group=ctx.group)
        return split_sequence(grad, ctx.dim, ctx.group, segments=ctx.segments), None, None, None, None
