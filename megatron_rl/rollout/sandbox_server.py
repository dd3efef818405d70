"""``megatron-rl sandbox-server``: the python tool's sandbox behind HTTP, for clusters whose nodes cannot run it.

Run it on a machine where the sandbox runs (:func:`~megatron_rl.tools.sandbox.sandbox_problem` is None; it
refuses to start otherwise) and point the recipe's ``rollout.tool_sandbox.url`` at it. It speaks
SandboxFusion's API for Python (:mod:`megatron_rl.tools.sandbox_service` has the shapes and how a
:class:`~megatron_rl.tools.sandbox.SandboxResult` maps onto them):

- ``POST /run_code``: runs ``code`` in a new sandbox with the default
  :class:`~megatron_rl.tools.sandbox.SandboxLimits`, or tighter ones where the request asks
  (``run_timeout`` bounds the wall time, ``memory_limit_MB`` > 0 the memory; neither can raise the
  defaults). Another ``language``, or ``stdin``, ``files`` or ``fetch_files``, which this server does not
  support: a ``SandboxError`` response (200, as SandboxFusion answers a failed run). A body that is no
  ``run_code`` request: 422 with ``{"detail"}`` (FastAPI's status for a request failing its model);
- ``GET /health``: 200 ``{"status": "ok", "workers", "running", "max_running", "served"}``: the sandboxes
  allowed at once, running now, the most that ran at once, and the runs answered so far.

At most ``--workers`` sandboxes run at once; further requests wait for one to end. The API key is the
engines' (:mod:`megatron_rl.engines.access`): every path but ``/health`` needs ``Authorization: Bearer KEY``,
else 401 ``{"error":"Unauthorized"}``; the key comes from ``--api-key-file`` or the environment variable
``MEGATRON_RL_ENGINE_API_KEY``, and the server does not start without one (it runs whatever code it is
sent). It listens on 127.0.0.1 unless ``--host`` names one other address (never a wildcard).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from megatron_rl.engines.access import (
    API_KEY_ENV,
    UNAUTHORIZED_BODY,
    UNAUTHORIZED_STATUS,
    check_listen_host,
    is_authorized,
)
from megatron_rl.tools.sandbox import SandboxLimits, SandboxUnavailableError, run_sandboxed
from megatron_rl.tools.sandbox_service import run_code_response, sandbox_error_response

logger = logging.getLogger(__name__)

SUPPORTED_LANGUAGE = "python"
DEFAULT_LIMITS = SandboxLimits()
"""The most a request gets: the python tool's own limits, which a request may only tighten."""


class RequestError(ValueError):
    """A body that is no ``run_code`` request (answered 422)."""


@dataclass
class SandboxRuns:
    """The sandboxes of one server: at most ``workers`` at once, and what /health reports of them."""

    workers: int
    running: int = 0
    max_running: int = 0
    served: int = 0
    _slots: threading.BoundedSemaphore = field(init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        self._slots = threading.BoundedSemaphore(self.workers)

    def run(self, code: str, limits: SandboxLimits) -> dict[str, Any]:
        """The ``run_code`` response of ``code`` run in a sandbox, once one of the ``workers`` slots is free."""
        with self._slots:
            with self._lock:
                self.running += 1
                self.max_running = max(self.max_running, self.running)
            start = time.monotonic()
            try:
                response = run_code_response(run_sandboxed(code, limits), time.monotonic() - start)
            except SandboxUnavailableError as exc:
                logger.error("the sandbox failed: %s", exc)
                response = sandbox_error_response(str(exc))
            finally:
                with self._lock:
                    self.running -= 1
                    self.served += 1
        return response

    def health(self) -> dict[str, Any]:
        with self._lock:
            return {
                "status": "ok",
                "workers": self.workers,
                "running": self.running,
                "max_running": self.max_running,
                "served": self.served,
            }


def request_limits(body: dict[str, Any], defaults: SandboxLimits = DEFAULT_LIMITS) -> SandboxLimits:
    """``defaults`` tightened by the request's ``run_timeout`` (wall seconds; SandboxFusion's default 10) and
    ``memory_limit_MB`` (> 0; SandboxFusion's -1 means none asked); RequestError for a bad value."""
    run_timeout = body.get("run_timeout", 10)
    memory_mb = body.get("memory_limit_MB", -1)
    if isinstance(run_timeout, bool) or not isinstance(run_timeout, int | float) or not run_timeout > 0:
        raise RequestError(f"run_timeout must be a positive number, got {run_timeout!r}")
    if isinstance(memory_mb, bool) or not isinstance(memory_mb, int):
        raise RequestError(f"memory_limit_MB must be an integer, got {memory_mb!r}")
    wall = min(float(run_timeout), defaults.wall_time_s)
    memory = defaults.memory_bytes if memory_mb <= 0 else min(memory_mb << 20, defaults.memory_bytes)
    return replace(defaults, wall_time_s=wall, memory_bytes=memory)


def answer_run_code(runs: SandboxRuns, body: Any) -> tuple[int, dict[str, Any]]:
    """(HTTP status, JSON body) answering the ``run_code`` request ``body`` (module docstring)."""
    if not isinstance(body, dict) or not isinstance(body.get("code"), str) or "language" not in body:
        return 422, {"detail": "a run_code request needs 'code' (a string) and 'language'"}
    language = body["language"]
    if language != SUPPORTED_LANGUAGE:
        return 200, sandbox_error_response(f"language {language!r} is not served here: only {SUPPORTED_LANGUAGE!r}")
    unsupported = [name for name in ("stdin", "files", "fetch_files") if body.get(name)]
    if unsupported:
        return 200, sandbox_error_response(f"{', '.join(unsupported)}: not supported by megatron-rl sandbox-server")
    try:
        limits = request_limits(body)
    except RequestError as exc:
        return 422, {"detail": str(exc)}
    return 200, runs.run(body["code"], limits)


class _Handler(BaseHTTPRequestHandler):
    runs: SandboxRuns
    api_key: str
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        logger.info("%s " + format, self.address_string(), *args)

    def _reply(self, status: int, payload: Any) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self, path: str) -> bool:
        if is_authorized(self.command, path, self.headers.get("Authorization"), self.api_key):
            return True
        self._reply(UNAUTHORIZED_STATUS, UNAUTHORIZED_BODY)
        return False

    def do_GET(self) -> None:
        path = self.path.partition("?")[0]
        if not self._authorized(path):
            return
        if path == "/health":
            self._reply(200, self.runs.health())
        else:
            self._reply(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        path = self.path.partition("?")[0]
        if not self._authorized(path):
            return
        if path != "/run_code":
            self._reply(404, {"detail": "Not Found"})
            return
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as exc:
            self._reply(422, {"detail": f"body is not JSON: {exc}"})
            return
        self._reply(*answer_run_code(self.runs, body))


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024  # requests beyond the workers wait in their threads, not in the listen backlog
    daemon_threads = True


def build_server(host: str, port: int, workers: int, api_key: str) -> ThreadingHTTPServer:
    """The sandbox server bound to ``host:port`` (call ``serve_forever``); ValueError for a wildcard ``host``,
    ``workers`` < 1 or an empty ``api_key``."""
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if not api_key:
        raise ValueError("the sandbox server needs an API key")
    handler = type("SandboxHandler", (_Handler,), {"runs": SandboxRuns(workers), "api_key": api_key})
    return _Server((check_listen_host(host), port), handler)


def read_api_key(api_key_file: Path | None, environ: dict[str, str]) -> str:
    """The key from ``api_key_file`` (stripped), else from :data:`API_KEY_ENV`; ValueError naming both when
    neither holds one."""
    key = api_key_file.read_text().strip() if api_key_file is not None else environ.get(API_KEY_ENV, "")
    if not key:
        source = f"--api-key-file {api_key_file} is empty" if api_key_file is not None else f"${API_KEY_ENV} is unset"
        raise ValueError(
            f"the sandbox server runs any code it is sent, so it needs an API key: {source}; set {API_KEY_ENV} "
            "(the run's key: start the run with the same value) or pass --api-key-file"
        )
    return key
