"""Reward scoring in worker processes: a slow verifier does not stall generation, a failing one does not stop the run.

Each response is scored alone, by one of ``num_workers`` spawned processes (``spawn``: the parent
runs HTTP threads, which ``fork`` must not copy), each driven over a pipe by a thread of the pool
(:mod:`megatron_rl.rollout.worker_processes`, shared with the tool pool).
A group's responses travel in ``num_workers`` contiguous chunks (one chunk per worker at most), each
sent in one message; the worker scores the chunk's responses one after another and sends each
answer as soon as it has it, so the parent applies the timeout to every response and a chunk costs
one round trip instead of one per response (the tiny run scores 512 responses per step).
Workers are started and checked at construction, so the first step does not pay their start-up.
The reward is looked up by name inside the worker (:func:`megatron_rl.data.get_reward`: a
registered name or ``pkg.module:fn``). A served reward (``data.reward: remote`` or ``judge``) instead comes
pickled to each worker, which calls it with the response and its prompt: the reward server's
(:class:`megatron_rl.data.remote_reward.RemoteReward`, one kept-alive connection per worker) or the judge's
engines' (:class:`megatron_rl.rollout.judge_reward.JudgeReward`); so every failure below is the same for a
local and a served reward: a request still failing after its retries raises in the worker. Workers are daemonic: a reward may run
subprocesses, but not start ``multiprocessing`` children.

Failures are per response. A reward that raises, returns something other than a ``RewardOutput``,
or kills its worker process scores the response as failed (``failure="error"``); one still running
after ``timeout_s`` (``data.reward_timeout_s``) too (``failure="timeout"``): its worker is killed
and a fresh one takes the next response. A failed response gets the score the reward gives the
empty response (the contract probe, judged wrong: the reward's own score of a wrong answer) and
``correct=False``; each failure is logged once, with the exception and the response. Scores come
back in the responses' order, whichever worker scored them.
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from megatron_rl.rollout.worker_processes import STARTUP_TIMEOUT_S, WorkerExit, WorkerProcess, WorkerSlot, stop_threads

if TYPE_CHECKING:
    from megatron_rl.data.rewards import ServedReward

logger = logging.getLogger(__name__)

Failure = Literal["error", "timeout"]


class Job(NamedTuple):
    """One response to score: a local reward reads the first three fields, a served one also the prompt."""

    response: str
    ground_truth: str
    extra_info: Mapping[str, Any]
    prompt: str = ""


Answer = tuple[float, bool, str | None, str | None]
"""A worker's answer: score, correct, the response's answer (see ``RewardOutput.answer``), and the traceback
when the reward failed (else None)."""


@dataclass(frozen=True)
class ScoredResponse:
    """The score of one response and its answer; ``failure`` says why the reward gave none (the score is then the
    failed one, and the answer None)."""

    score: float
    correct: bool
    failure: Failure | None = None
    answer: str | None = None


def _load_reward(reward: str, served: ServedReward | None) -> Callable[[Job], Answer]:
    """In a worker: the function that scores one job, with ``served`` when given, else the reward looked up by
    name."""
    from megatron_rl.data import RewardOutput, get_reward

    if served is not None:
        scorer = served

        def call(job: Job) -> RewardOutput:
            return scorer(job.response, job.ground_truth, job.extra_info, job.prompt)

    else:
        fn = get_reward(reward)

        def call(job: Job) -> RewardOutput:
            return fn(job.response, job.ground_truth, job.extra_info)

    def score(job: Job) -> Answer:
        try:
            output = call(job)
            if not isinstance(output, RewardOutput):
                raise TypeError(f"the reward returned {type(output).__name__}, not a RewardOutput")
            return (output.score, output.correct, output.answer, None)
        except Exception as exc:
            return (0.0, False, None, "".join(traceback.format_exception(exc)).rstrip())

    return score


def _start_worker(reward: str, served: ServedReward | None) -> WorkerProcess:
    """A new worker process for ``reward`` (not yet ready)."""
    return WorkerProcess(f"reward-{reward}", _load_reward, reward, served)


def _wait_ready(worker: WorkerProcess, reward: str) -> None:
    """Return once ``worker`` has loaded the reward; RuntimeError when it died, failed or took too long."""
    reason = worker.wait_ready(STARTUP_TIMEOUT_S)
    if reason is not None:
        raise RuntimeError(
            f"data.reward: a reward worker for {reward!r} did not start within {STARTUP_TIMEOUT_S:.0f} s ({reason}); "
            "run `megatron-rl validate` on the recipe to see why"
        )


def _failure_detail(answer: Answer | WorkerExit) -> str:
    """The traceback of a failed answer, or the exit code of a worker that died on the job."""
    if isinstance(answer, WorkerExit):
        return f"the reward worker process exited with code {answer.exitcode}"
    return str(answer[3])


class _GroupScores:
    """The scores of one group's responses, filled in by the pool's threads; ``future`` resolves when all are in."""

    def __init__(self, size: int) -> None:
        self.future: Future[list[ScoredResponse]] = Future()
        self._scores: list[ScoredResponse | None] = [None] * size
        self._missing = size
        self._lock = threading.Lock()
        if size == 0:
            self._resolve(lambda: self.future.set_result([]))

    def set(self, index: int, scored: ScoredResponse) -> None:
        """Record response ``index``; the last one resolves the future (unless it was cancelled)."""
        with self._lock:
            self._scores[index] = scored
            self._missing -= 1
            complete = self._missing == 0
        if complete:
            self._resolve(lambda: self.future.set_result(self._complete_scores()))

    def _complete_scores(self) -> list[ScoredResponse]:
        scores = [scored for scored in self._scores if scored is not None]
        assert len(scores) == len(self._scores), "every response was scored"
        return scores

    def fail(self, exc: BaseException) -> None:
        """The group cannot be scored (a worker does not start): its future raises ``exc``."""
        self._resolve(lambda: self.future.set_exception(exc))

    def _resolve(self, settle: Callable[[], None]) -> None:
        with self._lock:
            if self.future.done() or not self.future.set_running_or_notify_cancel():
                return
            settle()


class RewardPool:
    """``num_workers`` processes scoring responses with the reward named ``reward`` (see the module docstring).

    ``served``: the served reward of ``reward="remote"`` or ``"judge"`` (each worker gets a copy); the probe then
    goes to it. Raises ValueError for ``num_workers`` < 1, RuntimeError when a worker
    does not start or the reward fails on the empty-response probe that sets the failed score.
    """

    def __init__(self, reward: str, num_workers: int, *, timeout_s: float, served: ServedReward | None = None) -> None:
        if num_workers < 1:
            raise ValueError(f"reward num_workers must be >= 1, got {num_workers}")
        from megatron_rl.data.rewards import EMPTY_RESPONSE_PROBE

        self.reward, self.timeout_s, self.served = reward, timeout_s, served
        workers = [_start_worker(reward, served) for _ in range(num_workers)]
        try:
            for worker in workers:
                _wait_ready(worker, reward)
            (probe,) = workers[0].run([Job(*EMPTY_RESPONSE_PROBE)], timeout_s)
        except BaseException:
            for worker in workers:
                worker.kill()
            raise
        if not isinstance(probe, tuple) or probe[3] is not None:
            for worker in workers:
                worker.kill()
            reason = f"ran past {timeout_s} s" if probe is None else f"failed:\n{_failure_detail(probe)}"
            raise RuntimeError(
                f"data.reward: {reward!r} on the empty response {EMPTY_RESPONSE_PROBE!r} {reason}; "
                "the reward must score it (as wrong) quickly, since failed responses get that score"
            )
        self.failed_score = probe[0]
        self.num_workers = num_workers
        self._generation = 0  # bumped by replace_served: each thread renews its worker before its next chunk
        self._jobs: queue.SimpleQueue[tuple[_GroupScores, int, list[Job], str] | None] = queue.SimpleQueue()
        slots = [WorkerSlot(self._new_worker, worker) for worker in workers]
        self._threads = [threading.Thread(target=self._serve_jobs, args=(slot,), daemon=True) for slot in slots]
        for thread in self._threads:
            thread.start()

    def submit(
        self,
        responses: Sequence[str],
        ground_truth: str,
        extra_info: Mapping[str, Any],
        *,
        label: str = "",
        prompt: str = "",
    ) -> Future[list[ScoredResponse]]:
        """Future of one group's scores, in the order of ``responses``; ``label`` names the group in failure logs;
        ``prompt`` (the group's prompt text) reaches a served reward only.

        The responses are queued in at most ``num_workers`` contiguous chunks of near-equal size.
        """
        group = _GroupScores(len(responses))
        jobs = [Job(response, ground_truth, dict(extra_info), prompt) for response in responses]
        chunks = min(self.num_workers, len(jobs))
        for chunk in range(chunks):
            start, end = chunk * len(jobs) // chunks, (chunk + 1) * len(jobs) // chunks
            self._jobs.put((group, start, jobs[start:end], label))
        return group.future

    def replace_served(self, served: ServedReward) -> None:
        """Score with ``served`` from now on (e.g. the judge's engines at new addresses): every worker is replaced
        before its next chunk; chunks being scored finish with the old one."""
        self.served = served
        self._generation += 1

    def _serve_jobs(self, slot: WorkerSlot) -> None:
        """One pool thread: hand chunks of jobs to its worker, which is replaced when it hangs or dies, or when
        :meth:`replace_served` changed the reward."""
        generation = self._generation
        while (item := self._jobs.get()) is not None:
            group, index, jobs, label = item
            while jobs and not group.future.done():
                if generation != self._generation:
                    generation = self._generation
                    slot.stop()  # the slot starts a worker with the new reward
                try:
                    answers = slot.run(jobs, self.timeout_s)
                except RuntimeError as exc:
                    group.fail(exc)
                    break
                for offset, (job, answer) in enumerate(zip(jobs, answers, strict=False)):
                    group.set(index + offset, self._scored(answer, label, index + offset, job))
                index, jobs = index + len(answers), jobs[len(answers) :]
        slot.stop()

    def _scored(self, answer: Answer | WorkerExit | None, label: str, index: int, job: Job) -> ScoredResponse:
        """The score of a worker's ``answer`` (None: the job ran past the timeout and its worker is replaced)."""
        if answer is None:
            detail = f"ran past data.reward_timeout_s={self.timeout_s} s; its worker process was killed and replaced"
            return self._failed("timeout", detail, label, index, job)
        if isinstance(answer, WorkerExit) or answer[3] is not None:
            return self._failed("error", _failure_detail(answer), label, index, job)
        return ScoredResponse(answer[0], answer[1], answer=answer[2])

    def _new_worker(self) -> WorkerProcess:
        worker = _start_worker(self.reward, self.served)
        _wait_ready(worker, self.reward)
        return worker

    def _failed(self, failure: Failure, detail: str, label: str, index: int, job: Job) -> ScoredResponse:
        response, ground_truth = job.response, job.ground_truth
        logger.warning(
            "reward %r %s on response %d of group %s; it scores %s (the empty response's score, counted in "
            "rollout/reward_%ss): ground truth %r, response %r\n%s",
            self.reward,
            "failed" if failure == "error" else "timed out",
            index,
            label or "?",
            self.failed_score,
            failure,
            ground_truth[:200],
            response[:1000],
            detail,
        )
        return ScoredResponse(self.failed_score, False, failure)

    def close(self) -> None:
        """Stop the workers; scores still queued are cancelled."""
        stop_threads(self._jobs, self._threads, lambda item: item[0].future.cancel())
