"""Rollout routing replay (R3) through Megatron-core's ``RouterReplay``.

With ``moe_enable_routing_replay`` every ``TopKRouter`` owns a
``RouterReplay``; under ``RouterReplayAction.REPLAY_FORWARD`` it takes its
top-k expert indices from ``target_topk_idx`` instead of its own top-k, and
gathers the router's probabilities at those experts. :class:`RoutingReplay`
holds this rank's routers and, before each micro-batch's forward pass, hands
each one its slice of the batch's ``routed_experts`` [B, S, L, K]:

* layer: the router's global layer number (1-based) selects ``[:, :, number - 1]``;
* tokens: Megatron's router sees hidden states [S_local, B] flattened
  sequence-major; with sequence parallelism TP rank r holds positions
  ``[r * S / tp, (r + 1) * S / tp)``. The slice is laid out the same way.
  A packed micro-batch is the stream [1, T] (``packing``): the experts are
  packed like the tokens (pad tokens get experts ``0..K-1``) and sliced along T.
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


class RoutingReplay:
    """Replays given experts in the MoE routers of this rank's model chunks."""

    def __init__(self, chunks: Sequence[torch.nn.Module], *, sequence_parallel: bool) -> None:
        routers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
        self._replays: list[tuple[int, RouterReplay]] = [
            (router.layer_number - 1, router.router_replay) for router in routers if router.router_replay is not None
        ]
        if routers and not self._replays:
            raise ValueError("routing replay needs the model built with moe_enable_routing_replay=True")
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

    def set_micro_batch(self, batch: ActorBatch, layout: PackedLayout | None = None) -> None:
        """Give every router of this rank its experts for ``batch``'s forward pass (see :meth:`check_batch`).

        ``layout``: the micro-batch runs packed with this layout (None: padded [B, S]).
        """
        self.check_batch(batch)
        experts_BSLK = batch.routed_experts
        if layout is not None:
            distinct_K = torch.arange(experts_BSLK.shape[-1], dtype=experts_BSLK.dtype, device=experts_BSLK.device)
            experts_BSLK = pack_tokens(experts_BSLK, layout, fill=distinct_K)
        local_BSLK = self._local_positions(experts_BSLK)
        for layer, replay in self._replays:
            replay.set_target_indices(local_BSLK[:, :, layer].transpose(0, 1).reshape(-1, local_BSLK.shape[-1]))

    def _local_positions(self, experts_BSLK: torch.Tensor) -> torch.Tensor:
        if not self._sequence_parallel:
            return experts_BSLK
        tp = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        return experts_BSLK.chunk(tp, dim=1)[rank]

    @contextmanager
    def replaying(self) -> Iterator[None]:
        """Routers replay given experts inside the block; their targets are cleared on exit."""
        for _, replay in self._replays:
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            yield
        finally:
            for _, replay in self._replays:
                replay.clear_router_replay_action()
                replay.clear_indices()
