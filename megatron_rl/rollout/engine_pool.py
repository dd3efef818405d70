"""The rollout engines a manager sends its requests to: round-robin, a bounded number in flight, aborts, recovery.

Requests go to the engines in use round-robin (:meth:`EnginePool.next_engine`), each sent on a thread
of a pool of ``max_concurrent_requests`` threads per engine, so at most that many (per engine, on
average) are in flight. A request whose engine process is gone fails with
:class:`~megatron_rl.engines.engine.EngineUnavailableError`; the manager holds it until the rest of
its batch has answered, then :meth:`EnginePool.recover` restarts the crashed engines through the
``recover`` hook and the held requests go again, unchanged, to the engines it says are ready.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from megatron_rl.engines.engine import EngineUnavailableError, RolloutEngine
from megatron_rl.engines.protocol import GenerateRequest, GenerateResult

Recovery = Callable[[Sequence[tuple[RolloutEngine, EngineUnavailableError]]], Sequence[RolloutEngine]]
"""Restarts the crashed engines given (each with one of its errors); returns the engines ready to take
requests now (all of them, or those without a restart still waiting for its weights)."""


class EnginePool:
    """Sends ``/generate`` requests to ``engines`` round-robin and aborts them by request id.

    The pool never shuts engines down; :meth:`close` stops its request threads only.
    """

    def __init__(
        self, engines: Sequence[RolloutEngine], max_concurrent_requests: int, recover: Recovery | None = None
    ) -> None:
        if not engines:
            raise ValueError("the rollout needs at least one engine")
        self.engines = list(engines)
        self._recover = recover
        self._threads = ThreadPoolExecutor(max_workers=max_concurrent_requests * len(self.engines))
        self._cycle = itertools.cycle(self.engines)

    def next_engine(self) -> RolloutEngine:
        """The engine in use whose turn it is to take a request."""
        return next(self._cycle)

    def generate(self, engine: RolloutEngine, request: GenerateRequest) -> Future[list[GenerateResult]]:
        """Send ``request`` to ``engine`` on a request thread; the future holds its answers (one per sample)."""
        return self._threads.submit(engine.generate, request)

    @staticmethod
    def abort(engine: RolloutEngine, rid: str) -> None:
        """Abort request ``rid`` on ``engine``; an engine found gone has nothing to abort (its own request
        fails the same way)."""
        with contextlib.suppress(EngineUnavailableError):
            engine.abort(rid)

    def use_engines(self, engines: Sequence[RolloutEngine]) -> None:
        """Send the next requests round-robin over ``engines`` (some of the pool's engines, or all)."""
        self._cycle = itertools.cycle(list(engines))

    def recover(self, failures: Sequence[tuple[RolloutEngine, EngineUnavailableError]]) -> int:
        """Hand each crashed engine (with its first error) to the ``recover`` hook and use the engines it
        says are ready; how many engines crashed. Without a hook, the first error is raised."""
        if self._recover is None:
            raise failures[0][1]
        first_error: dict[int, tuple[RolloutEngine, EngineUnavailableError]] = {}
        for engine, error in failures:
            first_error.setdefault(id(engine), (engine, error))
        self.use_engines(self._recover(list(first_error.values())))
        return len(first_error)

    def close(self) -> None:
        """Stop the request threads, cancelling requests not yet sent."""
        self._threads.shutdown(wait=True, cancel_futures=True)
