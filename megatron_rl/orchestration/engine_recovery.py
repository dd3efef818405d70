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

With ``train.max_staleness`` > 0 the training rollout generates beside training, when the trainer
ranks hold weights newer than the ones being generated with, so a crashed engine cannot be given
its weights then. :class:`DeferredEngineRecovery` restarts it and leaves it out: its requests go to
the engines still running (same seeds, so the same responses), and the restarted engine rejoins at
the next weight sync (:meth:`DeferredEngineRecovery.before_sync`, then the sync delivers the new
weights to every engine). With no other engine running, :class:`AsyncEngineCrashError` ends the run,
which resumes from its latest checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from megatron_rl.engines import EngineError, RolloutEngine
from megatron_rl.orchestration.engine_host import EngineAddress, EngineHosts
from megatron_rl.orchestration.errors import AsyncEngineCrashError, EngineRestartLimitError
from megatron_rl.orchestration.memory_handover import HandOver
from megatron_rl.orchestration.trainer_group import TrainerGroup


class EngineRecovery:
    """Restarts crashed engines of ``hosts`` (``max_restarts`` in all, over the run); see the module docstring."""

    def __init__(self, hosts: EngineHosts, trainers: TrainerGroup, hand_over: HandOver, *, max_restarts: int) -> None:
        self.hosts, self.trainers, self.hand_over = hosts, trainers, hand_over
        self.max_restarts = max_restarts
        self.restarts = 0

    def __call__(self, crashed: Sequence[tuple[RolloutEngine, EngineError]]) -> list[RolloutEngine]:
        """Restart each crashed engine and re-sync the weights; returns every engine, all ready to generate.

        ``crashed``: each engine with the error of one of its failed requests (it names the exit code
        and log tail). Raises EngineRestartLimitError once the run has used ``max_restarts``.
        """
        self.trainers.engines_restarted(self.restart(crashed))
        self.hand_over.resync()
        return list(self.hosts.clients)

    def restart(self, crashed: Sequence[tuple[RolloutEngine, EngineError]]) -> dict[int, EngineAddress]:
        """Start a new process for each crashed engine, within the budget; ``{engine index: (name, host, port)}``."""
        restarted: dict[int, EngineAddress] = {}
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
        return restarted


class DeferredEngineRecovery:
    """Restarts crashed engines during a generation beside training; they rejoin at the next weight sync."""

    def __init__(self, recovery: EngineRecovery) -> None:
        self.recovery = recovery
        self._awaiting_weights: dict[int, EngineAddress] = {}

    def __call__(self, crashed: Sequence[tuple[RolloutEngine, EngineError]]) -> list[RolloutEngine]:
        """Restart each crashed engine (within the shared budget); returns the engines that still hold the
        weights being generated with. Raises AsyncEngineCrashError when none does."""
        self._awaiting_weights |= self.recovery.restart(crashed)
        clients = self.recovery.hosts.clients
        running: list[RolloutEngine] = [c for i, c in enumerate(clients) if i not in self._awaiting_weights]
        if not running:
            names = ", ".join(clients[index].name for index in sorted(self._awaiting_weights))
            raise AsyncEngineCrashError(
                f"engine(s) {names} crashed while the next step was generated beside training (train.max_staleness > "
                "0), and no other engine holds the weights that generation uses: a restarted engine gets weights "
                "only at the next sync, which waits for this generation. The checkpoints written so far are kept "
                "and the run resumes from the latest when started again; with more engines (cluster.cpu_engines, "
                f"rollout.num_gpus) the others take the crashed one's requests. The crash: {crashed[0][1]}"
            )
        return running

    def before_sync(self) -> list[RolloutEngine]:
        """Point the trainer ranks' weight sync at the engines restarted since the last sync (the sync that
        follows gives them the new weights); every engine, which the rollout manager may use again."""
        if self._awaiting_weights:
            self.recovery.trainers.engines_restarted(self._awaiting_weights)
            self._awaiting_weights = {}
        return list(self.recovery.hosts.clients)
