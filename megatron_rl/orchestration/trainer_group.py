"""The trainer ranks as one object the driver calls by method, each method the contract of one phase.

Every method runs on all ranks at once (the work inside is collective) and says whose result
counts; a rank's error re-raises in the driver. A reader follows a call from the loop to the
method here and on to :class:`~megatron_rl.orchestration.trainer_worker.TrainerWorker`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import ray

from megatron_rl.actor.step_data import StepData
from megatron_rl.orchestration.trainer_worker import ShardReceipt, TrainerWorker
from megatron_rl.orchestration.worker_group import RankArgs, RankWorkerGroup, by_reference


def _for_every_node(directory: Path) -> str:
    """``directory`` resolved against the driver's working directory: a rank on another node has its own."""
    return str(directory.resolve())


class TrainerGroup:
    """The ranks of ``ranks`` (a RankWorkerGroup of TrainerWorkers)."""

    def __init__(self, ranks: RankWorkerGroup[TrainerWorker]) -> None:
        self._ranks = ranks
        self._dp_ranks: list[int] = ranks.call(TrainerWorker.data_parallel_rank)

    @property
    def world_size(self) -> int:
        """Number of trainer ranks."""
        return self._ranks.world_size

    @property
    def pids(self) -> list[int]:
        """Each trainer rank's process id, in rank order."""
        return self._ranks.pids

    @property
    def data_parallel_size(self) -> int:
        """Number of data-parallel ranks, hence of shards per step."""
        return max(self._dp_ranks) + 1

    def train_step(self, shards: Sequence[StepData]) -> tuple[dict[str, float], list[ShardReceipt]]:
        """One step, ``shards[d]`` to every rank of data-parallel rank ``d`` (old/ref log-probs on the ranks).

        Each shard is put into Ray's object store once and fetched by the ranks that train on it;
        no rank receives another rank's samples. Returns the actor's metrics (rank 0's; equal on
        every rank) and each rank's receipt, in rank order.

        Raises:
            ValueError: not one shard per data-parallel rank.
        """
        if len(shards) != self.data_parallel_size:
            raise ValueError(f"got {len(shards)} shards for {self.data_parallel_size} data-parallel ranks")
        refs = [ray.put(shard) for shard in shards]
        results = self._ranks.call_per_rank(
            TrainerWorker.train_step, [RankArgs(by_reference(refs[d])) for d in self._dp_ranks]
        )
        receipts = [receipt for _, receipt in results]
        for receipt, dp_rank in zip(receipts, self._dp_ranks, strict=True):
            if receipt.sample_ids != tuple(shards[dp_rank].sample_ids.tolist()):
                raise RuntimeError(f"trainer rank {receipt.rank} trained on other samples than DP shard {dp_rank}")
        return results[0][0], receipts

    def offload(self, *, keep_params: bool = False) -> None:
        """Every rank moves its actor state to host memory (``keep_params``: parameters stay)."""
        self._ranks.call(TrainerWorker.offload, keep_params=keep_params)

    def reload(self) -> None:
        """Every rank brings back what :meth:`offload` moved, bit for bit."""
        self._ranks.call(TrainerWorker.reload)

    def device_memory(self) -> list[dict[str, int]]:
        """Each rank's GPU bytes (:meth:`TrainerWorker.device_memory`), in rank order."""
        return self._ranks.call(TrainerWorker.device_memory)

    def connect_engines(self, addresses: Sequence[tuple[str, str, int]]) -> None:
        """Every rank's weight sync delivers to the engines at ``addresses`` (name, host, port), in engine order."""
        self._ranks.call(TrainerWorker.connect_engines, list(addresses))

    def sync_weights(self, version: int) -> float:
        """Deliver the current weights to every engine as ``version``; the slowest rank's seconds."""
        return max(self._ranks.call(TrainerWorker.sync_weights, version))

    def engines_restarted(self, addresses: dict[int, tuple[str, str, int]]) -> None:
        """Every rank's weight sync now delivers each engine index of ``addresses`` at its (name, host, port)."""
        self._ranks.call(TrainerWorker.engines_restarted, addresses)

    def save_checkpoint(self, directory: Path) -> None:
        """Every rank writes its shards and generator states into ``directory``."""
        self._ranks.call(TrainerWorker.save_checkpoint, _for_every_node(directory))

    def export_hf(self, directory: Path) -> None:
        """The ranks write the current weights as a Hugging Face model directory ``directory`` together."""
        self._ranks.call(TrainerWorker.export_hf, _for_every_node(directory))

    def load_checkpoint(self, directory: Path, *, reseed: int | None = None) -> None:
        """Every rank restores its part of ``directory`` (``reseed``: another layout, see TrainerWorker)."""
        self._ranks.call(TrainerWorker.load_checkpoint, _for_every_node(directory), reseed=reseed)

    def close(self) -> None:
        """Release the ranks' transports and process groups, then end their actors."""
        try:
            self._ranks.call(TrainerWorker.close)
        finally:
            self._ranks.shutdown()
