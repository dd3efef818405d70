"""Context parallelism's load-balanced sequence split, and the gathers that undo it.

Megatron's layout (``get_batch_on_this_cp_rank``, the RoPE table's
``get_pos_emb_on_this_cp_rank`` and Transformer Engine's causal CP attention all
assume it): a sequence of S positions is cut into ``2 * cp`` equal chunks and CP rank
r holds chunks r and ``2 * cp - 1 - r``, in that order, so every rank gets as much
causal-attention work. S must be a multiple of ``2 * cp``.

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

from typing import Any, Literal

import torch
import torch.distributed as dist

GradOwnership = Literal["sum", "own"]


def local_positions(seq_length: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[S / cp] int64: the sequence positions CP ``rank`` of ``cp`` holds, in its local order.

    Raises:
        ValueError: S is not a positive multiple of ``2 * cp``, or ``rank`` is outside ``[0, cp)``.
    """
    if seq_length <= 0 or seq_length % (2 * cp):
        raise ValueError(
            f"a sequence split over {cp} CP ranks needs a multiple of 2*cp={2 * cp} tokens; got {seq_length}"
        )
    if not 0 <= rank < cp:
        raise ValueError(f"CP rank {rank} is outside [0, {cp})")
    chunk = seq_length // (2 * cp)
    starts = (rank * chunk, (2 * cp - 1 - rank) * chunk)
    return torch.cat([torch.arange(start, start + chunk, device=device) for start in starts])


def split_sequence(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """This CP rank's positions of ``tensor`` along ``dim`` (see :func:`local_positions`)."""
    positions = local_positions(tensor.shape[dim], group.size(), group.rank(), tensor.device)
    return tensor.index_select(dim, positions)


def gather_sequence(local: torch.Tensor, dim: int, group: dist.ProcessGroup, grads: GradOwnership) -> torch.Tensor:
    """The whole sequence along ``dim`` from every CP rank's ``local`` piece; differentiable (see the module doc)."""
    result: torch.Tensor = _GatherSequence.apply(local, dim, group, grads)
    return result


def _order(seq_length: int, cp: int, device: torch.device) -> torch.Tensor:
    """Position of each gathered element (rank-major concatenation of the local pieces) in the sequence."""
    return torch.cat([local_positions(seq_length, cp, rank, device) for rank in range(cp)])


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, dim: int, group: dist.ProcessGroup, grads: GradOwnership) -> Any:
        cp = group.size()
        pieces = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(pieces, local.contiguous(), group=group)
        gathered = torch.cat(pieces, dim=dim)
        ctx.dim, ctx.group, ctx.grads = dim, group, grads
        whole = torch.empty_like(gathered)
        return whole.index_copy_(dim, _order(gathered.shape[dim], cp, local.device), gathered)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        if ctx.grads == "sum":
            grad = grad.clone(memory_format=torch.contiguous_format)  # reduced in place; autograd may hold the input
            dist.all_reduce(grad, group=ctx.group)
        return split_sequence(grad, ctx.dim, ctx.group), None, None, None
