"""Which trainer rank feeds which engine rank in a colocated weight sync.

Colocated on GPUs, engine ``e`` uses the GPUs of trainer ranks ``e*k .. e*k+k-1`` (``k`` GPUs per
engine; :mod:`megatron_rl.plan.placement`), so its TP rank ``t`` shares a GPU with trainer rank
``e*k+t`` and is fed by that rank alone: it opens handles of its own GPU only, and every node
serves its own engines. The same rule with a stride of ``world_size // engines`` places CPU engines
(which share no device) beside the trainer ranks that feed them. An engine rank with expert
parallelism loads only its own experts (:func:`engine_rank_experts`), so it is fed only those.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineFeed:
    """The engine rank one trainer rank feeds: ``engine``'s TP rank ``tp_rank``.

    ``feeders``: the trainer ranks feeding that engine, in its TP-rank order; the first one
    gathers their payloads and posts the engine's requests.
    """

    engine: int
    tp_rank: int
    feeders: tuple[int, ...]

    @property
    def posts(self) -> bool:
        """Whether this rank posts the engine's requests (it feeds the engine's TP rank 0)."""
        return self.tp_rank == 0


def engine_feeders(world_size: int, engine_sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """Each engine's feeding trainer ranks, in its TP-rank order.

    Engine ``e`` (``engine_sizes[e]`` TP ranks) is fed by ranks ``e*s .. e*s+engine_sizes[e]-1`` with
    stride ``s = world_size // len(engine_sizes)``. Raises ValueError when there are more engines
    than trainer ranks or an engine has more TP ranks than the stride (two engines would share a feeder).
    """
    if not engine_sizes:
        return []
    stride = world_size // len(engine_sizes)
    if stride == 0 or max(engine_sizes) > stride:
        raise ValueError(
            f"{len(engine_sizes)} colocated engines of {list(engine_sizes)} TP ranks cannot each be fed by their own "
            f"trainer ranks out of {world_size}: every engine rank needs a trainer rank of its own"
        )
    return [tuple(range(engine * stride, engine * stride + size)) for engine, size in enumerate(engine_sizes)]


def colocated_feeds(world_size: int, engine_sizes: Sequence[int]) -> list[EngineFeed | None]:
    """For each trainer rank ``0 .. world_size-1``, the engine rank it feeds (:func:`engine_feeders`), or None
    (it feeds none). Raises ValueError as :func:`engine_feeders`."""
    feeds: list[EngineFeed | None] = [None] * world_size
    for engine, feeders in enumerate(engine_feeders(world_size, engine_sizes)):
        for tp_rank, rank in enumerate(feeders):
            feeds[rank] = EngineFeed(engine, tp_rank, feeders)
    return feeds


def engine_rank_experts(tp_rank: int, tp_size: int, ep_size: int, num_experts: int) -> range:
    """The global experts that TP rank ``tp_rank`` of an SGLang 0.5.23 engine at ``tp_size`` x ``ep_size`` loads.

    SGLang splits the engine's TP ranks into ``ep_size`` MoE EP ranks of ``tp_size // ep_size`` (MoE
    TP) each, TP rank ``t`` in EP rank ``t // (tp_size // ep_size)`` (``distributed/parallel_state.py``,
    one MoE DP group), and places experts trivially (no EPLB): EP rank ``r`` holds the contiguous
    ``num_experts // ep_size`` from ``r * num_experts // ep_size``; its FusedMoE weight loader drops
    every other expert it is sent (``_map_global_expert_id_to_local_expert_id`` returns -1). Raises
    ValueError where ``ep_size`` does not divide ``tp_size`` and ``num_experts`` or ``tp_rank`` is
    not below ``tp_size``.
    """
    if tp_size % ep_size or num_experts % ep_size or not 0 <= tp_rank < tp_size:
        raise ValueError(
            f"TP rank {tp_rank} of an engine at TP {tp_size} x EP {ep_size} with {num_experts} experts: EP must divide "
            "both TP and the experts, and the rank must be below TP"
        )
    per_rank = num_experts // ep_size
    ep_rank = tp_rank // (tp_size // ep_size)
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)
