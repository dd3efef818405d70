"""Errors that end a run for a reason found while it runs (the CLI prints them without a traceback)."""

from __future__ import annotations


class NonFiniteTrainingError(RuntimeError):
    """Too many consecutive steps had an update skipped for NaN/Inf loss or gradients."""


class RankCallError(RuntimeError):
    """A trainer rank's process died during a call; the message names the rank, its node and the cause."""

    def __init__(self, rank: int, node_ip: str, method: str, cause: str) -> None:
        super().__init__(f"trainer rank {rank} on node {node_ip} died in {method}: {cause}")
        self.rank, self.node_ip = rank, node_ip


class EngineRestartLimitError(RuntimeError):
    """A rollout engine crashed once more after the run used ``rollout.max_engine_restarts``."""


class AsyncEngineCrashError(RuntimeError):
    """Every engine generating beside training crashed: none holds the weights that generation uses."""
