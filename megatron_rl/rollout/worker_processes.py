"""Spawned worker processes driven over pipes, for user code that may hang or crash (rewards, tools).

A :class:`WorkerProcess` is a ``spawn``\\ed daemonic process (the parent runs HTTP threads, which
``fork`` must not copy) that calls ``load(*args)`` once to get its job handler, says whether that
worked, then answers lists of jobs one answer a message, in order, each as soon as it has it. The
parent bounds each answer by a timeout. A :class:`WorkerSlot` is one pool thread's worker: started
when needed, killed after a job runs past its timeout, replaced after it dies. The handler must not
raise: an exception it lets out ends the worker (the job's answer is then a :class:`WorkerExit`).
:func:`stop_threads` ends a pool's threads, each stopping its worker.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

STARTUP_TIMEOUT_S = 300.0
"""Seconds a new worker process may take to start and load its handler."""
STOP_TIMEOUT_S = 5.0
"""Seconds a closing worker gets to exit before it is killed."""


@dataclass(frozen=True)
class WorkerExit:
    """The answer to a job whose worker process died (before or while answering it)."""

    exitcode: int | None


def _serve(conn: Connection, load: Callable[..., Callable[[Any], Any]], args: tuple[Any, ...]) -> None:
    """A worker: load the handler, send None (ready) or why not, then answer each list of jobs until None arrives."""
    try:
        handle = load(*args)
    except Exception as exc:
        conn.send(f"{type(exc).__name__}: {exc}")
        return
    conn.send(None)
    while (jobs := conn.recv()) is not None:
        for job in jobs:
            conn.send(handle(job))


class WorkerProcess:
    """One worker process and the parent's end of its pipe; ``load`` must be a module-level function."""

    def __init__(self, name: str, load: Callable[..., Callable[[Any], Any]], *args: Any) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, load, args), name=name, daemon=True)
        self.process.start()
        child.close()

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> str | None:
        """None once the worker has loaded its handler; else why it did not (and the worker is killed)."""
        reason = f"it did not answer within {timeout_s:.0f} s"
        if self._conn.poll(timeout_s):
            try:
                failure = self._conn.recv()
                if failure is None:
                    return None
                reason = str(failure)
            except EOFError:
                self.process.join(STOP_TIMEOUT_S)
                reason = f"it exited with code {self.process.exitcode}"
        self.kill()
        return reason

    def run(self, jobs: Sequence[Any], timeout_s: float) -> list[Any]:
        """The worker's answers to ``jobs``, in order, each awaited at most ``timeout_s`` after the one before.

        Fewer answers than jobs when the worker stopped early: the last answer is then None (the job
        ran past ``timeout_s``; the worker still runs it) or a :class:`WorkerExit` (the worker died
        before or on that job). The caller sends the jobs after it again, to another worker.
        """
        answers: list[Any] = []
        try:
            self._conn.send(list(jobs))
            while len(answers) < len(jobs):
                if not self._conn.poll(timeout_s):
                    return [*answers, None]
                answers.append(self._conn.recv())
        except (EOFError, OSError):
            self.process.join(STOP_TIMEOUT_S)
            answers.append(WorkerExit(self.process.exitcode))
        return answers

    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.process.is_alive()

    def kill(self) -> None:
        """Kill the process at once (a hung job) and wait for it."""
        self.process.kill()
        self.process.join()
        self._conn.close()

    def stop(self) -> None:
        """Ask the process to exit; kill it when it does not within ``STOP_TIMEOUT_S``."""
        with contextlib.suppress(OSError):
            self._conn.send(None)
        self.process.join(STOP_TIMEOUT_S)
        self.kill()


class WorkerSlot:
    """The worker of one pool thread: ``start`` makes a ready one (RuntimeError when it cannot) when there is none."""

    def __init__(self, start: Callable[[], WorkerProcess], worker: WorkerProcess | None = None) -> None:
        self._start = start
        self._worker = worker

    def run(self, jobs: Sequence[Any], timeout_s: float) -> list[Any]:
        """:meth:`WorkerProcess.run` on a live worker; one that ran past ``timeout_s`` is killed, to be replaced.

        Raises the RuntimeError of ``start`` when no worker can be started.
        """
        if self._worker is not None and not self._worker.alive():
            self._worker.kill()  # reaps the dead process and closes its pipe
            self._worker = None
        if self._worker is None:
            self._worker = self._start()
        answers = self._worker.run(jobs, timeout_s)
        if answers and answers[-1] is None:
            self._worker.kill()
            self._worker = None
        return answers

    def stop(self) -> None:
        """Stop the worker, if any."""
        if self._worker is not None:
            self._worker.stop()
            self._worker = None


def stop_threads[T](
    jobs: queue.SimpleQueue[T | None], threads: Sequence[threading.Thread], cancel: Callable[[T], object]
) -> None:
    """End a pool: ``cancel`` each job still queued, then send each thread None (its signal to stop) and join it."""
    while True:
        try:
            item = jobs.get_nowait()
        except queue.Empty:
            break
        if item is not None:
            cancel(item)
    for _ in threads:
        jobs.put(None)
    for thread in threads:
        thread.join()
