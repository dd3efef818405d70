"""Who holds the accelerator memory between the phases of a step: engines or trainer.

The driver calls three transitions, in this order within a step:
:meth:`HandOver.to_training` (before the log-prob and training phases),
:meth:`HandOver.sync_weights` (after training), :meth:`HandOver.to_rollout`
(before generation and validation). Disaggregated engines have GPUs of their own,
so :class:`HandOver` only syncs. :class:`ColocatedHandOver` moves memory so that
the trainer's optimizer state and the engines' KV cache are never resident at
once, in the order slime and verl use (verl's for the sync, since our offloaded
parameters cannot be read):

1. to_training: engines release ``weights``, ``kv_cache``, ``cuda_graph``; then
   the actor reloads its parameters, gradients and optimizer state;
2. sync_weights: the actor offloads gradients and optimizer state (parameters
   stay); engines resume ``weights``; the trainer sends its weights;
3. to_rollout: the actor offloads its parameters; engines resume ``kv_cache``
   and ``cuda_graph``.

A LoRA run's engines (``adapter`` given) keep their weights, the base they serve (a sync sends the adapter alone,
so released base weights could never come back): step 1 releases only ``kv_cache`` and ``cuda_graph``.

A checkpoint needs the trainer's state: the driver calls ``to_training`` before it and
nothing after; the next ``to_rollout`` re-syncs the last version first
(``time/weight_resync_s``).

Peaks: during a sync the parameters are held twice (actor and engines), as in verl;
at start-up (see :func:`release_engine_caches`) the actor's whole state and the
engines' weights are held together, without KV cache. Each transition is idempotent
(it only moves what is not already where it should be) and times its steps as
``time/<phase>_s`` in the caller's timer. A release needs idle engines (SGLang
asserts it): the rollout manager returns only after every request has answered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import Literal, Protocol

from megatron_rl.engines import RolloutEngine
from megatron_rl.engines.protocol import MEMORY_TAGS
from megatron_rl.rollout.policy_adapter import PolicyAdapter

Timer = Callable[[str], AbstractContextManager[None]]
"""``timer(phase)``: a context manager recording the phase's seconds (the driver's PhaseTimer)."""
CACHE_TAGS = ("kv_cache", "cuda_graph")


class TrainerMemory(Protocol):
    """What the hand-over asks of the trainer ranks (:class:`~megatron_rl.orchestration.trainer_group.TrainerGroup`)."""

    def offload(self, *, keep_params: bool = False) -> None: ...

    def reload(self) -> None: ...

    def sync_weights(self, version: int) -> float: ...


def _untimed(phase: str) -> AbstractContextManager[None]:
    return nullcontext()


def on_every_engine(engines: Sequence[RolloutEngine], action: Callable[[RolloutEngine], None]) -> None:
    """``action(engine)`` on all engines concurrently; re-raises the first failure after all have answered.

    One engine is called from the calling thread (no pool: its kept-alive connection serves every move).
    """
    if len(engines) == 1:
        action(engines[0])
        return
    with ThreadPoolExecutor(max_workers=max(1, len(engines))) as pool:
        futures = [pool.submit(action, engine) for engine in engines]
    for future in futures:
        future.result()


def release_engine_caches(engines: Sequence[RolloutEngine]) -> None:
    """Start-up of a colocated run: engines keep their (initial) weights and free KV cache and CUDA graphs."""
    on_every_engine(engines, lambda engine: engine.release_memory(list(CACHE_TAGS)))


class HandOver:
    """Disaggregated engines: nothing moves; :meth:`sync_weights` delivers the trainer's weights.

    ``adapter``: a LoRA run's (the trainers sync the adapter alone); every sync names its version's adapter there.
    """

    def __init__(
        self, engines: Sequence[RolloutEngine], trainers: TrainerMemory, adapter: PolicyAdapter | None = None
    ) -> None:
        self.engines = list(engines)
        self.trainers = trainers
        self.adapter = adapter
        self.version: int | None = None

    def to_training(self, timer: Timer = _untimed) -> None:
        """Make the trainer's state resident for log-probs, training or a checkpoint."""

    def sync_weights(self, version: int, timer: Timer = _untimed, *, phase: str = "weight_sync") -> None:
        """Deliver the trainer's weights to every engine as ``version`` (timed as ``phase``)."""
        with timer(phase):
            self.trainers.sync_weights(version)
        self.version = version
        if self.adapter is not None:
            self.adapter.synced(version)

    def to_rollout(self, timer: Timer = _untimed) -> None:
        """Make the engines ready to generate with the last synced weights."""

    def resync(self, timer: Timer = _untimed) -> None:
        """After an engine restart, every engine idle: deliver the last synced weights again (timed as
        ``engine_resync``), so the restarted engine, which loaded the initial checkpoint, holds them too.
        Nothing to do before the first sync: every engine holds the initial checkpoint."""
        if self.version is not None:
            self.sync_weights(self.version, timer, phase="engine_resync")


ActorState = Literal["all", "params", "none"]


class ColocatedHandOver(HandOver):
    """Engines and trainer on the same GPUs: the transitions of the module docstring.

    Starts from the state :func:`release_engine_caches` leaves (engines hold current weights only,
    the actor is fully resident) unless told otherwise.
    """

    def __init__(
        self,
        engines: Sequence[RolloutEngine],
        trainers: TrainerMemory,
        adapter: PolicyAdapter | None = None,
        *,
        engine_tags: Sequence[str] = ("weights",),
        engine_weights_current: bool = True,
        actor: ActorState = "all",
    ) -> None:
        super().__init__(engines, trainers, adapter)
        self.released_tags = set(CACHE_TAGS if adapter is not None else MEMORY_TAGS)
        self.engine_tags = set(engine_tags)
        self.engine_weights_current = engine_weights_current
        self.actor: ActorState = actor

    def _engines(self, verb: Literal["release", "resume"], tags: Sequence[str]) -> None:
        tags = [tag for tag in MEMORY_TAGS if tag in tags]
        if verb == "release":
            on_every_engine(self.engines, lambda engine: engine.release_memory(tags))
            self.engine_tags -= set(tags)
        else:
            on_every_engine(self.engines, lambda engine: engine.resume_memory(tags))
            self.engine_tags |= set(tags)

    def to_training(self, timer: Timer = _untimed) -> None:
        release = self.engine_tags & self.released_tags
        if release:
            with timer("engines_release"):
                self._engines("release", sorted(release))
            self.engine_weights_current = "weights" in self.engine_tags
        if self.actor != "all":
            with timer("actor_reload"):
                self.trainers.reload()
            self.actor = "all"

    def sync_weights(self, version: int, timer: Timer = _untimed, *, phase: str = "weight_sync") -> None:
        if self.actor == "none":
            raise RuntimeError("the actor's parameters are offloaded; call to_training() before sync_weights()")
        if self.actor == "all":
            with timer("actor_offload_optimizer"):
                self.trainers.offload(keep_params=True)
            self.actor = "params"
        if "weights" not in self.engine_tags:
            with timer("engines_resume_weights"):
                self._engines("resume", ["weights"])
        super().sync_weights(version, timer, phase=phase)
        self.engine_weights_current = True

    def resync(self, timer: Timer = _untimed) -> None:
        """As :meth:`HandOver.resync`, through the usual moves: engines release, the actor reloads, the sync,
        and back to generation (a restarted engine starts with all its memory, like the others here)."""
        if self.version is not None:
            self.to_training(timer)
            self.sync_weights(self.version, timer, phase="engine_resync")
            self.to_rollout(timer)

    def to_rollout(self, timer: Timer = _untimed) -> None:
        """Also re-syncs the last synced version when the engines released it since (after a checkpoint)."""
        if not self.engine_weights_current:
            if self.version is None:
                raise RuntimeError("the engines released their weights and none were synced yet; call sync_weights()")
            self.sync_weights(self.version, timer, phase="weight_resync")
        if self.actor != "none":
            with timer("actor_offload_params"):
                self.trainers.offload()
            self.actor = "none"
        missing = [tag for tag in CACHE_TAGS if tag not in self.engine_tags]
        if missing:
            with timer("engines_resume_cache"):
                self._engines("resume", missing)
