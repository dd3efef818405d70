"""Which rollout a training step trains on, and when it is generated: the staleness schedule.

With ``train.max_staleness`` s = 0 the step's rollout is generated when the step starts, with the
weights of the step before (the synchronous loop). With s > 0 (disaggregated engines only, a
recipe check) the pipeline keeps s generated steps ready: before step 1 it generates steps 1..s
with the initial weights, and while step k trains it generates step k+s in a background thread
with the weights the engines hold then, those after step k-1. The driver waits for that
generation before it syncs the weights of step k, so no request ever sees two weight versions.
Every sample of step j > s therefore comes from the weights after step j-s-1 (the initial ones
for j <= s): the schedule is fixed, so an async run is as deterministic as a synchronous one.

The steps generated but not yet trained are the run's carried-over rollouts; with partial rollouts
the rollout manager also carries unfinished groups into its next generation. A checkpoint saves
both (:class:`CarriedOver`, :func:`save_carried_over`) and a resume loads them, so a resumed run
trains on the very samples the uninterrupted one would have.

Idle time, per step: ``time/trainer_idle_s`` is what the trainer waited for generation (the
whole generation in the synchronous loop; the part of the background generation that outlasted
training, plus any generation before the step, in the async one); ``time/engine_idle_s`` is the
step's wall time minus its generation seconds.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_rl.checkpoint.layout import CARRIED_OVER_FILE
from megatron_rl.rollout.groups import RolloutStep
from megatron_rl.rollout.partial import PartialGroup


@dataclass
class PipelinedRollout:
    """A generated rollout step and the step it is for (each sample carries the engine's ``weight_version``)."""

    step: int
    rollout: RolloutStep


@dataclass
class CarriedOver:
    """What a checkpoint carries into the next start: rollouts generated for later steps, in step order,
    and the rollout manager's unfinished (partial-rollout) groups, in their order."""

    rollouts: list[PipelinedRollout]
    unfinished: list[PartialGroup]

    def __bool__(self) -> bool:
        return bool(self.rollouts or self.unfinished)


class RolloutPipeline:
    """Rollouts for steps in order under the schedule of the module docstring.

    ``generate(step)`` produces the rollout of ``step`` (the rollout manager's ``generate_step``; the
    pipeline calls it in step order, one at a time). ``carried`` are rollouts restored from a
    checkpoint, in step order.
    """

    def __init__(
        self,
        generate: Callable[[int], RolloutStep],
        *,
        max_staleness: int,
        last_step: int,
        carried: list[PipelinedRollout] | None = None,
    ) -> None:
        self._generate = generate
        self.max_staleness, self.last_step = max_staleness, last_step
        self._ready: deque[PipelinedRollout] = deque(carried or [])
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-ahead")
        self._ahead: Future[PipelinedRollout] | None = None
        self._generated_s = 0.0

    def _produce(self, step: int) -> PipelinedRollout:
        started = time.perf_counter()
        rollout = self._generate(step)
        self._generated_s += time.perf_counter() - started
        return PipelinedRollout(step, rollout)

    def take(self, step: int) -> PipelinedRollout:
        """The rollout ``step`` trains on; generates what the schedule needs first (the trainer waits).

        Then, with staleness s > 0, starts generating step ``step + s`` in the background (if the run
        has it). Call :meth:`wait_ahead` before the weights change.
        """
        self._generated_s = 0.0
        next_step = self._ready[-1].step + 1 if self._ready else step
        while next_step <= min(step + self.max_staleness - 1, self.last_step) or not self._ready:
            self._ready.append(self._produce(next_step))
            next_step += 1
        taken = self._ready.popleft()
        if taken.step != step:
            raise RuntimeError(f"the rollout pipeline holds step {taken.step} where step {step} is due")
        ahead = self._ready[-1].step + 1 if self._ready else step + 1
        if ahead <= min(step + self.max_staleness, self.last_step):
            self._ahead = self._worker.submit(self._produce, ahead)
        return taken

    def wait_ahead(self) -> None:
        """Wait for the background generation (if any) and queue its rollout (re-raising its failure)."""
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            self._ready.append(ahead.result())

    @property
    def generated_s(self) -> float:
        """Seconds of generation for the step since its :meth:`take` (before it and in the background)."""
        return self._generated_s

    def carried_over(self) -> list[PipelinedRollout]:
        """The rollouts generated and not yet trained on, in step order (call after :meth:`wait_ahead`)."""
        return list(self._ready)

    def close(self) -> None:
        """Stop the background thread without waiting: a generation still running (the run failed during
        training) ends with its requests when the engines stop (``RunResources.close`` stops them before
        the rollout managers); its errors are dropped."""
        self._worker.shutdown(wait=False, cancel_futures=True)


def save_carried_over(checkpoint_dir: Path, carried: CarriedOver) -> None:
    """Write ``carried`` into the (staging) checkpoint as ``CARRIED_OVER_FILE`` (nothing when it is empty)."""
    if carried:
        records = {
            "rollouts": [(item.step, item.rollout) for item in carried.rollouts],
            "unfinished": carried.unfinished,
        }
        torch.save(records, checkpoint_dir / CARRIED_OVER_FILE)


def load_carried_over(checkpoint_dir: Path, name: str | None) -> CarriedOver:
    """What :func:`save_carried_over` wrote into ``checkpoint_dir`` (nothing when ``name`` is None)."""
    if name is None:
        return CarriedOver([], [])
    records = torch.load(checkpoint_dir / name, weights_only=False)  # our own checkpoint's rollout groups
    rollouts = [PipelinedRollout(step, rollout) for step, rollout in records["rollouts"]]
    return CarriedOver(rollouts, records["unfinished"])
