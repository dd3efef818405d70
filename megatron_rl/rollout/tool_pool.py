"""Tool calls in worker processes: a slow tool does not stall generation, a failing one does not stop the run.

Each call runs in one of ``num_workers`` spawned processes (:mod:`megatron_rl.rollout.worker_processes`),
each driven by a thread of the pool, so up to ``num_workers`` calls run at once. Every worker imports
the pool's tools by name at start (:func:`megatron_rl.tools.get_tool`) and checks that each can run on
this machine (:func:`megatron_rl.tools.tool_problem`: the ``python`` tool needs its sandbox); the pool's
construction fails when a worker cannot, naming ``rollout.tools``, the tool and why. With a sandbox service
(``rollout.tool_sandbox``, :func:`sandbox_service`), each worker's python tool sends its code there instead
(:func:`megatron_rl.tools.sandbox_service.use_service`), and needs no local sandbox. A registered name
travels to the workers as the import path of its function, so a tool registered outside
:mod:`megatron_rl.tools` (where this process imported it) loads there too.

A call never raises: its :class:`ToolOutput` is the tool's text, or, on a failure, a short message
the model reads as the tool's output, with ``failure`` saying which: ``"error"`` (the tool raised,
returned something other than a string, or killed its worker process), ``"timeout"`` (it ran past
``timeout_s``: its worker is killed and a fresh one takes the next call), ``"unknown_tool"`` (the
model called a tool the pool does not have) or ``"limit"`` (one of the tool's own limits stopped the work,
a :class:`~megatron_rl.tools.registry.LimitedOutput`: the text is the tool's, e.g. the python tool's output
up to its sandbox's stop). Each failure is logged once, with the call and, for an
error, the traceback.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from megatron_rl.engines.access import API_KEY_ENV
from megatron_rl.named_functions import import_path
from megatron_rl.rollout.worker_processes import STARTUP_TIMEOUT_S, WorkerExit, WorkerProcess, WorkerSlot, stop_threads
from megatron_rl.tools.calls import ToolCall
from megatron_rl.tools.registry import LimitedOutput, get_tool, tool_call_name, tool_problem
from megatron_rl.tools.sandbox_service import SandboxService, use_service

if TYPE_CHECKING:
    from megatron_rl.config.schema import ToolSandboxConfig

logger = logging.getLogger(__name__)

ToolFailure = Literal["error", "timeout", "unknown_tool", "limit"]
ToolJob = tuple[str, dict[str, Any], dict[str, Any]]
"""A call as a worker gets it: the tool's recipe entry, the arguments, the context."""
ToolAnswer = tuple[str | None, str | None]
"""A worker's answer: the tool's text and None, or None and the traceback of its failure."""


@dataclass(frozen=True)
class ToolOutput:
    """What the model reads as a call's output; ``failure`` says why the tool gave none (``text`` then says so)."""

    text: str
    failure: ToolFailure | None = None


def _import_path(tool: str) -> str:
    """The ``"package.module:function"`` of a recipe entry: a worker imports that module, which registers the tool
    wherever it is defined (a registered name is known where its module was imported, as in this process)."""
    if ":" in tool:
        return tool
    try:
        fn = get_tool(tool)
    except ValueError as exc:
        raise RuntimeError(f"rollout.tools: {exc}") from exc
    return import_path(fn)


def sandbox_service(config: ToolSandboxConfig | None) -> SandboxService | None:
    """The service ``rollout.tool_sandbox`` names, with the run's API key from this process's environment
    (:data:`~megatron_rl.engines.access.API_KEY_ENV`; unset: no key sent); None for the local sandbox."""
    if config is None:
        return None
    return SandboxService(config.url, config.timeout_s, config.retries, os.environ.get(API_KEY_ENV) or None)


def _load_tools(paths: Mapping[str, str], sandbox: SandboxService | None) -> Callable[[ToolJob], ToolAnswer]:
    """In a worker: point the python tool at ``sandbox`` (None: the local one), import every tool (recipe
    entry -> import path) and check it can run here; return the function that runs one call."""
    use_service(sandbox)
    functions = {}
    for tool, path in paths.items():
        fn = get_tool(path)
        problem = tool_problem(fn)
        if problem is not None:
            raise RuntimeError(f"tool {tool!r} cannot run on this machine: {problem}")
        functions[tool] = fn

    def call(job: ToolJob) -> ToolAnswer:
        name, arguments, context = job
        try:
            text = functions[name](arguments, context)
            if not isinstance(text, str):
                raise TypeError(f"the tool returned {type(text).__name__}, not str")
            return (text, None)
        except Exception as exc:
            return (None, "".join(traceback.format_exception(exc)).rstrip())

    return call


class ToolPool:
    """``num_workers`` processes running calls of ``tools`` (recipe entries), each bounded by ``timeout_s``;
    the python tool runs its code on ``sandbox`` (None: the local sandbox).

    The model calls a tool by its registered name, or by the function's name for an import path
    (:func:`megatron_rl.tools.registry.tool_call_name`; the whole entry is accepted too). Raises ValueError for ``num_workers`` < 1,
    ``timeout_s`` <= 0, no tools, or two entries the model would call by the same name; RuntimeError
    naming ``rollout.tools`` when a worker cannot import a tool, a tool cannot run here, or a worker
    does not start.
    """

    def __init__(
        self, tools: Sequence[str], num_workers: int, timeout_s: float, sandbox: SandboxService | None = None
    ) -> None:
        if num_workers < 1 or not timeout_s > 0:
            raise ValueError(f"tool pool: num_workers must be >= 1 and timeout_s > 0, got {num_workers}, {timeout_s}")
        call_names = [tool_call_name(tool) for tool in tools]
        if not tools or len(set(call_names)) != len(call_names):
            raise ValueError(f"rollout.tools: {list(tools)} must name at least one tool, each called by its own name")
        self.tools = tuple(tools)
        self.timeout_s = timeout_s
        self._entries = {
            **dict(zip(self.tools, self.tools, strict=True)),
            **dict(zip(call_names, self.tools, strict=True)),
        }
        self._paths = {tool: _import_path(tool) for tool in self.tools}
        self._sandbox = sandbox
        workers = [WorkerProcess("tools", _load_tools, self._paths, sandbox) for _ in range(num_workers)]
        try:
            for worker in workers:
                _wait_ready(worker)
        except BaseException:
            for worker in workers:
                worker.kill()
            raise
        self._calls: queue.SimpleQueue[tuple[Future[ToolOutput], ToolCall, ToolJob] | None] = queue.SimpleQueue()
        slots = [WorkerSlot(self._new_worker, worker) for worker in workers]
        self._threads = [threading.Thread(target=self._serve_calls, args=(slot,), daemon=True) for slot in slots]
        for thread in self._threads:
            thread.start()

    def submit(self, call: ToolCall, context: Mapping[str, Any]) -> Future[ToolOutput]:
        """Future of the output of ``call`` with the episode's ``context`` (see the module docstring)."""
        future: Future[ToolOutput] = Future()
        entry = self._entries.get(call.name)
        if entry is None:
            text = f"error: unknown tool {call.name!r}; tools: {', '.join(map(tool_call_name, self.tools))}"
            future.set_result(self._failed(call, "unknown_tool", text, "the pool has no such tool"))
            return future
        self._calls.put((future, call, (entry, dict(call.arguments), dict(context))))
        return future

    def close(self) -> None:
        """Stop the workers; calls still queued are cancelled."""
        stop_threads(self._calls, self._threads, lambda item: item[0].cancel())

    def _serve_calls(self, slot: WorkerSlot) -> None:
        """One pool thread: run calls on its worker, which is replaced when it hangs or dies."""
        while (item := self._calls.get()) is not None:
            future, call, job = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                (answer,) = slot.run([job], self.timeout_s)
            except RuntimeError as exc:  # no worker starts: the machine, not the call, is broken
                future.set_exception(exc)
                continue
            future.set_result(self._output(call, answer))
        slot.stop()

    def _output(self, call: ToolCall, answer: ToolAnswer | WorkerExit | None) -> ToolOutput:
        """The output of a worker's ``answer`` (None: the call ran past the timeout; its worker is replaced)."""
        if answer is None:
            detail = f"ran past rollout.tool_timeout_s={self.timeout_s} s; its worker process was killed and replaced"
            return self._failed(call, "timeout", f"error: the tool ran past {self.timeout_s:g} s", detail)
        if isinstance(answer, WorkerExit):
            message = f"error: the tool's process exited with code {answer.exitcode}"
            return self._failed(call, "error", message, "its worker process died; a fresh one takes the next call")
        text, failed = answer
        if failed is not None:
            last_line = failed.rpartition("\n")[2]  # the exception's type and message
            return self._failed(call, "error", f"error: {last_line}", failed)
        assert text is not None, "an answer holds the text or the failure"
        if isinstance(text, LimitedOutput):  # the model reads the output as it is; the stop is counted
            return self._failed(call, "limit", str(text), "a limit of the tool stopped the work")
        return ToolOutput(text)

    def _new_worker(self) -> WorkerProcess:
        worker = WorkerProcess("tools", _load_tools, self._paths, self._sandbox)
        _wait_ready(worker)
        return worker

    def _failed(self, call: ToolCall, failure: ToolFailure, text: str, detail: str) -> ToolOutput:
        logger.warning(
            "tool call %r failed (%s): arguments %.1000r; the model reads %r\n%s",
            call.name,
            failure,
            call.arguments,
            text,
            detail,
        )
        return ToolOutput(text, failure)


def _wait_ready(worker: WorkerProcess) -> None:
    """Return once ``worker`` has loaded every tool; RuntimeError naming ``rollout.tools`` and why when not."""
    reason = worker.wait_ready(STARTUP_TIMEOUT_S)
    if reason is not None:
        raise RuntimeError(f"rollout.tools: a tool worker did not start: {reason}")
