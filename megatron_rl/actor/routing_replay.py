"""Rollout routing replay (R3) through Megatron-core's ``RouterReplay``.

With ``moe_enable_routing_replay`` every ``TopKRouter`` owns a
``RouterReplay``; under ``RouterReplayAction.REPLAY_FORWARD`` it takes its
top-k expert indices from ``target_topk_idx`` instead of its own top-k, and
gathers the router's probabilities at those experts. :class:`RoutingReplay`
holds this rank's routers and, before each micro-batch's forward pass, hands
each one its slice of the batch's ``routed_experts`` [B, S, L, K]:

* layer: the router's global layer number (1-based) selects ``[:, :, number - 1]``;
* tokens: Megatron's router sees hidden states [S_local, B] flattened
  sequence-major; with context parallelism a CP rank holds its load-balanced
  share of the row (``parallel.context_parallel``), of which, with sequence
  parallelism, TP rank r holds positions ``[r * S_cp / tp, (r + 1) * S_cp / tp)``.
  The slice is laid out the same way.
  A packed micro-batch is the stream [1, T] (``packing``): the experts are
  packed like the tokens (pad tokens get experts ``0..K-1``), split per segment
  for context parallelism and sliced along T.

Recomputation (``train.recompute: full``) runs each layer's forward again
during the backward pass, when pipelined schedules have already given the
routers the next micro-batch's targets. Megatron's ``REPLAY_BACKWARD`` action
serves that: every ``set_target_indices`` also appends the targets to the
router's FIFO, and a router in ``REPLAY_BACKWARD`` pops the oldest. Only the
routers of the chunk that runs the micro-batch get its targets, in the
schedule's forward order, and they switch to ``REPLAY_BACKWARD`` as soon as
that forward returns; backward passes (and their recomputation) run in the
same micro-batch order per chunk (1F1B and interleaved), so each recomputed
forward pops exactly the experts its original forward replayed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.packing import PackedLayout, pack_tokens
from megatron_rl.parallel.context_parallel import split_sequence


class RoutingReplay:
    """Replays given experts in the MoE routers of this rank's model chunks."""

    def __init__(self, chunks: Sequence[torch.nn.Module], *, sequence_parallel: bool) -> None:
        routers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
        self._replays = _router_replays(chunks)
        if routers and not self._replays:
            raise ValueError("routing replay needs the model built with moe_enable_routing_replay=True")
        self._by_chunk: dict[int, list[tuple[int, RouterReplay]]] = {}
        self._sequence_parallel = sequence_parallel

    @property
    def layer_indices(self) -> list[int]:
        """0-based decoder layer indices of this rank's routers, in model order."""
        return [layer for layer, _ in self._replays]

    def check_batch(self, batch: ActorBatch) -> None:
        """Raise before any forward pass if ``batch`` cannot be replayed (every rank checks the same batch).

        Raises:
            ValueError: the batch has no ``routed_experts``, or fewer layers
                than the model routes in.
        """
        if batch.routed_experts is None:
            raise ValueError(
                "algorithm.routing_replay is on but the batch has no routed_experts; ask the rollout engine for "
                "them (SGLang: enable_return_routed_experts / return_routed_experts) or turn routing_replay off"
            )
        num_layers = batch.routed_experts.shape[2]
        if self._replays and max(self.layer_indices) >= num_layers:
            raise ValueError(
                f"routed_experts has {num_layers} layers; the model routes in layer {max(self.layer_indices)} (0-based)"
            )

    def set_micro_batch(self, batch: ActorBatch, chunk: torch.nn.Module, layout: PackedLayout | None = None) -> None:
        """Give the routers of ``chunk`` their experts for ``batch``'s forward pass (see :meth:`check_batch`).

        ``chunk``: the model chunk (as the schedule passes it) about to run ``batch``;
        ``layout``: the micro-batch runs packed with this layout (None: padded [B, S]).
        """
        self.check_batch(batch)
        replays = self._chunk_replays(chunk)
        experts_BSLK = batch.routed_experts
        assert experts_BSLK is not None, "check_batch raises without routed_experts"
        if layout is not None:
            distinct_K = torch.arange(experts_BSLK.shape[-1], dtype=experts_BSLK.dtype, device=experts_BSLK.device)
            experts_BSLK = pack_tokens(experts_BSLK, layout, fill=distinct_K)
        local_BSLK = self._local_positions(experts_BSLK, layout)
        for layer, replay in replays:
            replay.set_target_indices(local_BSLK[:, :, layer].transpose(0, 1).reshape(-1, local_BSLK.shape[-1]))
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def forward_done(self, chunk: torch.nn.Module) -> None:
        """``chunk``'s forward of the micro-batch returned: its routers replay from the FIFO in recomputation."""
        for _, replay in self._chunk_replays(chunk):
            replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    def _chunk_replays(self, chunk: torch.nn.Module) -> list[tuple[int, RouterReplay]]:
        if id(chunk) not in self._by_chunk:
            self._by_chunk[id(chunk)] = _router_replays([chunk])
        return self._by_chunk[id(chunk)]

    def _local_positions(self, experts_BSLK: torch.Tensor, layout: PackedLayout | None) -> torch.Tensor:
        cp_group = parallel_state.get_context_parallel_group()
        if cp_group.size() > 1:
            segments = layout.cu_seqlens if layout is not None else None
            experts_BSLK = split_sequence(experts_BSLK, 1, cp_group, segments=segments)
        if not self._sequence_parallel:
            return experts_BSLK
        tp: int = parallel_state.get_tensor_model_parallel_world_size()
        rank: int = parallel_state.get_tensor_model_parallel_rank()
        return experts_BSLK.chunk(tp, dim=1)[rank]

    @contextmanager
    def replaying(self) -> Iterator[None]:
        """One schedule call replays (targets come from :meth:`set_micro_batch`); all replay state is cleared on exit."""
        try:
            yield
        finally:
            for _, replay in self._replays:
                replay.clear_router_replay_action()
                replay.clear_indices()


def _router_replays(modules: Sequence[torch.nn.Module]) -> list[tuple[int, RouterReplay]]:
    """(0-based layer, RouterReplay) of every replaying router inside ``modules``, in model order."""
    return [
        (module.layer_number - 1, module.router_replay)
        for root in modules
        for module in root.modules()
        if isinstance(module, TopKRouter) and module.router_replay is not None
    ]
