"""Rollout engines that crash are started again, up to ``rollout.max_engine_restarts`` times in a run.

The rollout manager calls an :class:`EngineRecovery` when requests failed because their engine's
process is gone (:class:`~megatron_rl.rollout.EngineUnavailableError`), once every other request of
the generation batch has answered, so all engines are idle. For each crashed engine it starts a new
process on the engine's bundle (:meth:`EngineHosts.restart`), points every trainer rank's weight sync
at it (:meth:`TrainerGroup.engines_restarted`) and, once all are back, delivers the last synced
weights to the engines again (:meth:`HandOver.resync`). The manager then resubmits the failed
requests unchanged: their sampling seeds make the responses those the crashed engine would have
given, so a crash does not change the run's results.

Past the budget, :class:`EngineRestartLimitError` ends the run, naming the engine, its exit code and
its log tail (from the error of its last failed request).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from megatron_rl.orchestration.engine_host import EngineHosts
from megatron_rl.orchestration.errors import EngineRestartLimitError
from megatron_rl.orchestration.memory_handover import HandOver
from megatron_rl.orchestration.trainer_group import TrainerGroup
from megatron_rl.rollout import EngineError, RolloutEngine


class EngineRecovery:
    """Restarts crashed engines of ``hosts`` (``max_restarts`` in all, over the run); see the module docstring."""

    def __init__(self, hosts: EngineHosts, trainers: TrainerGroup, hand_over: HandOver, *, max_restarts: int) -> None:
        self.hosts, self.trainers, self.hand_over = hosts, trainers, hand_over
        self.max_restarts = max_restarts
        self.restarts = 0

    def __call__(self, crashed: Sequence[tuple[RolloutEngine, EngineError]]) -> None:
        """Restart each crashed engine and re-sync the weights; returns with every engine ready to generate.

        ``crashed``: each engine with the error of one of its failed requests (it names the exit code
        and log tail). Raises EngineRestartLimitError once the run has used ``max_restarts``.
        """
        restarted = {}
        for engine, error in crashed:
            if self.restarts >= self.max_restarts:
                raise EngineRestartLimitError(
                    f"engine {engine.name} crashed after {self.restarts} engine restarts in this run "
                    f"(rollout.max_engine_restarts={self.max_restarts}); the checkpoints written so far are kept, "
                    f"and the run resumes from the latest when started again. The crash: {error}"
                )
            started = time.perf_counter()
            index = next(i for i, client in enumerate(self.hosts.clients) if client is engine)
            restarted[index] = self.hosts.restart(index)
            self.restarts += 1
            print(
                f"# engine {engine.name} crashed ({str(error).splitlines()[0]}); started again on its bundle in "
                f"{time.perf_counter() - started:.1f} s ({self.restarts} of rollout.max_engine_restarts="
                f"{self.max_restarts}); its requests go again with their seeds",
                flush=True,
            )
        self.trainers.engines_restarted(restarted)
        self.hand_over.resync()
