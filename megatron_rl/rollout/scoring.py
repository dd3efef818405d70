"""Reward scoring in worker processes: a slow verifier does not stall generation, a failing one does not stop the run.

Each response is scored alone, by one of ``num_workers`` spawned processes (``spawn``: the parent
runs HTTP threads, which ``fork`` must not copy), each driven over a pipe by a thread of the pool.
A group's responses travel in ``num_workers`` contiguous chunks (one chunk per worker at most), each
sent in one message; the worker scores the chunk's responses one after another and sends each
answer as soon as it has it, so the parent applies the timeout to every response and a chunk costs
one round trip instead of one per response (the tiny run scores 512 responses per step).
Workers are started and checked at construction, so the first step does not pay their start-up.
The reward is looked up by name inside the worker (:func:`megatron_rl.data.get_reward`: a
registered name or ``pkg.module:fn``). Workers are daemonic: a reward may run subprocesses, but
not start ``multiprocessing`` children.

Failures are per response. A reward that raises, returns something other than a ``RewardOutput``,
or kills its worker process scores the response as failed (``failure="error"``); one still running
after ``timeout_s`` (``data.reward_timeout_s``) too (``failure="timeout"``): its worker is killed
and a fresh one takes the next response. A failed response gets the score the reward gives the
empty response (the contract probe, judged wrong: the reward's own score of a wrong answer) and
``correct=False``; each failure is logged once, with the exception and the response. Scores come
back in the responses' order, whichever worker scored them.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import queue
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Literal

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0
"""Seconds a new worker process may take to start and import the reward."""
STOP_TIMEOUT_S = 5.0
"""Seconds a closing worker gets to exit before it is killed."""

Failure = Literal["error", "timeout"]
Job = tuple[str, str, Mapping[str, Any]]
Answer = tuple[float, bool, str | None]
"""A worker's answer: score, correct, and the traceback when the reward failed (else None)."""


@dataclass(frozen=True)
class ScoredResponse:
    """The score of one response; ``failure`` says why the reward gave none (the score is then the failed one)."""

    score: float
    correct: bool
    failure: Failure | None = None


def _serve(conn: Connection, reward: str) -> None:
    """A worker: import the reward, say it is ready, then score each list of jobs until the pipe sends None.

    Every job of a list is answered by a message of its own, in the list's order, as soon as it is scored.
    """
    from megatron_rl.data import RewardOutput, get_reward

    fn = get_reward(reward)
    conn.send(None)
    while (jobs := conn.recv()) is not None:
        for job in jobs:
            try:
                output = fn(*job)
                if not isinstance(output, RewardOutput):
                    raise TypeError(f"the reward returned {type(output).__name__}, not a RewardOutput")
                conn.send((output.score, output.correct, None))
            except Exception as exc:
                conn.send((0.0, False, "".join(traceback.format_exception(exc)).rstrip()))


class _Worker:
    """One scoring process and the parent's end of its pipe."""

    def __init__(self, reward: str) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, reward), name=f"reward-{reward}", daemon=True)
        self.process.start()
        child.close()

    def wait_ready(self, reward: str) -> None:
        """Return once the worker has imported the reward; RuntimeError when it died or took too long."""
        if self._conn.poll(STARTUP_TIMEOUT_S):
            try:
                self._conn.recv()
                return
            except EOFError:
                pass
        self.kill()
        raise RuntimeError(
            f"data.reward: a reward worker for {reward!r} did not start within {STARTUP_TIMEOUT_S:.0f} s "
            f"(exit code {self.process.exitcode}); run `megatron-rl validate` on the recipe to see why"
        )

    def score(self, jobs: Sequence[Job], timeout_s: float) -> list[Answer | None]:
        """The worker's answers to ``jobs``, in order, each awaited at most ``timeout_s`` after the one before.

        Fewer answers than jobs when the worker stopped early: the last answer is then None (the job
        ran past ``timeout_s``) or a failure naming the exit code of a worker that died (before or on
        that job); the caller replaces the worker and sends the jobs after it again.
        """
        answers: list[Answer | None] = []
        try:
            self._conn.send(list(jobs))
            while len(answers) < len(jobs):
                if not self._conn.poll(timeout_s):
                    return [*answers, None]
                answers.append(self._conn.recv())
        except (EOFError, OSError):
            self.process.join(STOP_TIMEOUT_S)
            answers.append((0.0, False, f"the reward worker process exited with code {self.process.exitcode}"))
        return answers

    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.process.is_alive()

    def kill(self) -> None:
        """Kill the process at once (a hung reward) and wait for it."""
        self.process.kill()
        self.process.join()
        self._conn.close()

    def stop(self) -> None:
        """Ask the process to exit; kill it when it does not within ``STOP_TIMEOUT_S``."""
        with contextlib.suppress(OSError):
            self._conn.send(None)
        self.process.join(STOP_TIMEOUT_S)
        self.kill()


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

    Raises ValueError for ``num_workers`` < 1, RuntimeError when a worker does not start or the
    reward fails on the empty-response probe that sets the failed score.
    """

    def __init__(self, reward: str, num_workers: int, *, timeout_s: float) -> None:
        if num_workers < 1:
            raise ValueError(f"reward num_workers must be >= 1, got {num_workers}")
        from megatron_rl.data.rewards import EMPTY_RESPONSE_PROBE

        self.reward, self.timeout_s = reward, timeout_s
        workers = [_Worker(reward) for _ in range(num_workers)]
        try:
            for worker in workers:
                worker.wait_ready(reward)
            (probe,) = workers[0].score([EMPTY_RESPONSE_PROBE], timeout_s)
        except BaseException:
            for worker in workers:
                worker.kill()
            raise
        if probe is None or probe[2] is not None:
            for worker in workers:
                worker.kill()
            reason = f"ran past {timeout_s} s" if probe is None else f"failed:\n{probe[2]}"
            raise RuntimeError(
                f"data.reward: {reward!r} on the empty response {EMPTY_RESPONSE_PROBE!r} {reason}; "
                "the reward must score it (as wrong) quickly, since failed responses get that score"
            )
        self.failed_score = probe[0]
        self.num_workers = num_workers
        self._jobs: queue.SimpleQueue[tuple[_GroupScores, int, list[Job], str] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._serve_jobs, args=(w,), daemon=True) for w in workers]
        for thread in self._threads:
            thread.start()

    def submit(
        self, responses: Sequence[str], ground_truth: str, extra_info: Mapping[str, Any], *, label: str = ""
    ) -> Future[list[ScoredResponse]]:
        """Future of one group's scores, in the order of ``responses``; ``label`` names the group in failure logs.

        The responses are queued in at most ``num_workers`` contiguous chunks of near-equal size.
        """
        group = _GroupScores(len(responses))
        jobs: list[Job] = [(response, ground_truth, dict(extra_info)) for response in responses]
        chunks = min(self.num_workers, len(jobs))
        for chunk in range(chunks):
            start, end = chunk * len(jobs) // chunks, (chunk + 1) * len(jobs) // chunks
            self._jobs.put((group, start, jobs[start:end], label))
        return group.future

    def _serve_jobs(self, worker: _Worker | None) -> None:
        """One pool thread: hand chunks of jobs to its worker, replacing the worker when it hangs or dies."""
        while (item := self._jobs.get()) is not None:
            group, index, jobs, label = item
            while jobs and not group.future.done():
                try:
                    worker = worker if worker is not None and worker.alive() else self._new_worker()
                except RuntimeError as exc:
                    worker = None
                    group.fail(exc)
                    break
                answers = worker.score(jobs, self.timeout_s)
                for offset, (job, answer) in enumerate(zip(jobs, answers, strict=False)):
                    group.set(index + offset, self._scored(answer, label, index + offset, job))
                if answers[-1] is None:
                    worker.kill()
                    worker = None
                index, jobs = index + len(answers), jobs[len(answers) :]
        if worker is not None:
            worker.stop()

    def _scored(self, answer: Answer | None, label: str, index: int, job: Job) -> ScoredResponse:
        """The score of a worker's ``answer`` (None: the job ran past the timeout and its worker is replaced)."""
        if answer is None:
            detail = f"ran past data.reward_timeout_s={self.timeout_s} s; its worker process was killed and replaced"
            return self._failed("timeout", detail, label, index, job)
        if answer[2] is not None:
            return self._failed("error", answer[2], label, index, job)
        return ScoredResponse(answer[0], answer[1])

    def _new_worker(self) -> _Worker:
        worker = _Worker(self.reward)
        worker.wait_ready(self.reward)
        return worker

    def _failed(self, failure: Failure, detail: str, label: str, index: int, job: Job) -> ScoredResponse:
        response, ground_truth, _ = job
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
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].future.cancel()
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()
