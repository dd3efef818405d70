"""The trainer ranks as one object the driver calls by method, each method the contract of one phase.

Every method runs on all ranks at once (the work inside is collective) and says whose result
counts; a rank's error re-raises in the driver. A reader follows a call from the loop to the
method here and on to :class:`~megatron_rl.orchestration.trainer_worker.TrainerWorker`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rl.actor import ActorBatch
from megatron_rl.orchestration.worker_group import RankWorkerGroup


class TrainerGroup:
    """The ranks of ``ranks`` (a RankWorkerGroup of TrainerWorkers)."""

    def __init__(self, ranks: RankWorkerGroup) -> None:
        self._ranks = ranks

    @property
    def world_size(self) -> int:
        """Number of trainer ranks."""
        return self._ranks.world_size

    def compute_old_log_probs(self, batch: ActorBatch) -> torch.Tensor:
        """The current policy's [B, S] log-probs of ``batch`` (rank 0's; the others return None)."""
        return self._ranks.call("compute_old_log_probs", batch)[0]

    def compute_ref_log_probs(self, batch: ActorBatch) -> torch.Tensor:
        """The reference policy's [B, S] log-probs of ``batch`` (rank 0's)."""
        return self._ranks.call("compute_ref_log_probs", batch)[0]

    def train_step(self, batch: ActorBatch) -> dict[str, float]:
        """One optimizer step on ``batch``; the actor's metrics (equal on every rank: rank 0's)."""
        return self._ranks.call("train_step", batch)[0]

    def offload(self, *, keep_params: bool = False) -> None:
        """Every rank moves its actor state to host memory (``keep_params``: parameters stay)."""
        self._ranks.call("offload", keep_params=keep_params)

    def reload(self) -> None:
        """Every rank brings back what :meth:`offload` moved, bit for bit."""
        self._ranks.call("reload")

    def sync_weights(self, version: int) -> float:
        """Deliver the current weights to every engine as ``version``; the slowest rank's seconds."""
        return max(self._ranks.call("sync_weights", version))

    def save_checkpoint(self, directory: Path) -> None:
        """Every rank writes its shards and generator states into ``directory``."""
        self._ranks.call("save_checkpoint", str(directory))

    def export_hf(self, directory: Path) -> None:
        """The ranks write the current weights as a Hugging Face model directory ``directory`` together."""
        self._ranks.call("export_hf", str(directory))

    def load_checkpoint(self, directory: Path, *, reseed: int | None = None) -> None:
        """Every rank restores its part of ``directory`` (``reseed``: another layout, see TrainerWorker)."""
        self._ranks.call("load_checkpoint", str(directory), reseed=reseed)

    def close(self) -> None:
        """Release the ranks' transports and process groups, then end their actors."""
        try:
            self._ranks.call("close")
        finally:
            self._ranks.shutdown()
