"""The sandbox as a service: SandboxFusion's ``POST /run_code`` shapes, both ways, and the client the python tool uses.

Stdlib only (``urllib``): imports neither torch, Megatron nor Ray. ``megatron-rl sandbox-server``
(:mod:`megatron_rl.rollout.sandbox_server`) answers with :func:`run_code_response`; the python tool sends
its code with :func:`run_remote` when the recipe sets ``rollout.tool_sandbox`` (:func:`use_service` in each
tool worker). The shapes are SandboxFusion's (bytedance/SandboxFusion ``sandbox/server/sandbox_api.py``:
``RunCodeRequest``, ``RunCodeResponse``; ``sandbox/runners/types.py``: ``CommandRunResult``), so the client
also works against a SandboxFusion deployment, and a SandboxFusion client against our server:

- request: ``{"code", "language": "python", "run_timeout", "memory_limit_MB", "compile_timeout", "stdin",
  "files", "fetch_files"}``;
- response: ``{"status": "Success" | "Failed" | "SandboxError", "message", "compile_result": null,
  "run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error", "execution_time", "return_code",
  "stdout", "stderr"}, "executor_pod_name", "files"}``.

How a :class:`~megatron_rl.tools.sandbox.SandboxResult` maps onto ``run_result`` (SandboxFusion's semantics:
``Finished`` is a process that ended, whatever its code; ``TimeLimitExceeded`` a process killed at
``run_timeout``; ``Error`` a failure of the sandbox itself):

- stopped ``wall_time`` or ``cpu_time``: ``TimeLimitExceeded`` (SandboxFusion bounds wall time only; our
  CPU limit is a time limit too);
- every other result, stopped by ``memory``, ``processes``, ``file_size``, ``disk`` or ``output`` or not:
  ``Finished``, ``return_code`` the exit code (None for a sandbox killed at its output limit);
- the sandbox cannot be set up (:class:`~megatron_rl.tools.sandbox.SandboxUnavailableError`): ``Error``,
  and the response's ``status`` is ``SandboxError`` with the reason as ``message``.

The top-level ``status`` is SandboxFusion's ``parse_run_status``: ``Success`` for a return code of 0,
``Failed`` for a time limit or another code. One field is ours: ``"stopped"``, the exact stop reason
(SandboxFusion's statuses cannot tell memory from disk), so our client rebuilds the same
:class:`SandboxResult` the local sandbox gives and the model reads the same text either way. From a
response without it (SandboxFusion's), the client reads ``TimeLimitExceeded`` as ``wall_time`` and, for a
failed run, the stop named in stderr (:func:`~megatron_rl.tools.sandbox.stderr_stop_reason`), as the
local sandbox does.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from megatron_rl.tools.sandbox import SandboxLimits, SandboxResult, StopReason, stderr_stop_reason

TIME_STOPS: frozenset[StopReason] = frozenset({"wall_time", "cpu_time"})
BACKOFF_S = 0.5
"""Seconds before the first retry; each later retry waits twice as long as the one before, at most MAX_BACKOFF_S."""
MAX_BACKOFF_S = 8.0


class SandboxServiceError(RuntimeError):
    """The service gave no result: unreachable after the retries, no answer in time, a refusal (401, 4xx) or a
    ``SandboxError``; the message names the URL and why. The python tool lets it out: the call counts as failed."""


@dataclass(frozen=True)
class SandboxService:
    """Where the python tool sends its code: ``url`` (the service's base, ``/run_code`` is appended), seconds a
    request may take (``timeout_s``), retries after a connection error or a 5xx (``retries``) and the
    ``api_key`` sent as ``Authorization: Bearer`` (None: no header, e.g. a SandboxFusion deployment)."""

    url: str
    timeout_s: float = 60.0
    retries: int = 3
    api_key: str | None = None

    def __repr__(self) -> str:  # the key stays out of logs and tracebacks
        return f"SandboxService(url={self.url!r}, timeout_s={self.timeout_s}, retries={self.retries})"


_service: SandboxService | None = None


def use_service(service: SandboxService | None) -> None:
    """Make the python tool of this process send its code to ``service`` (None: the local sandbox)."""
    global _service
    _service = service


def current_service() -> SandboxService | None:
    """The service the python tool of this process uses, None for the local sandbox."""
    return _service


@contextlib.contextmanager
def service_in_use(service: SandboxService | None) -> Iterator[None]:
    """:func:`use_service` for the ``with`` block, then the one before again."""
    before = _service
    use_service(service)
    try:
        yield
    finally:
        use_service(before)


def run_code_request(code: str, limits: SandboxLimits) -> dict[str, Any]:
    """SandboxFusion's ``run_code`` request running ``code`` in Python within ``limits``' wall time and memory."""
    return {
        "code": code,
        "language": "python",
        "run_timeout": limits.wall_time_s,
        "memory_limit_MB": limits.memory_bytes >> 20,
        "compile_timeout": limits.wall_time_s,
        "stdin": None,
        "files": {},
        "fetch_files": [],
    }


def run_code_response(result: SandboxResult, execution_time: float) -> dict[str, Any]:
    """SandboxFusion's ``run_code`` response for ``result`` (the mapping of the module docstring)."""
    timed_out = result.stopped in TIME_STOPS
    run_result = {
        "status": "TimeLimitExceeded" if timed_out else "Finished",
        "execution_time": execution_time,
        "return_code": result.exit_code,
        "stdout": result.stdout,
        "stderr": result.stderr,
    }
    status = "Success" if not timed_out and result.exit_code == 0 else "Failed"
    return _response(status, "", run_result) | {"stopped": result.stopped}


def sandbox_error_response(message: str) -> dict[str, Any]:
    """SandboxFusion's ``run_code`` response when the sandbox itself failed or cannot run the request."""
    return _response("SandboxError", message, {"status": "Error", "stderr": message})


def _response(status: str, message: str, run_result: dict[str, Any]) -> dict[str, Any]:
    return {
        "status": status,
        "message": message,
        "compile_result": None,
        "run_result": run_result,
        "executor_pod_name": None,
        "files": {},
    }


def result_of_response(response: Any) -> SandboxResult:
    """The :class:`SandboxResult` a ``run_code`` response reports (module docstring); SandboxServiceError for a
    ``SandboxError``, a run that did not run, or a body that is not such a response."""
    if not isinstance(response, dict) or not isinstance(response.get("run_result"), dict):
        message = response.get("message") if isinstance(response, dict) else None
        raise SandboxServiceError(f"the response holds no run_result: {message or str(response)[:500]!r}")
    run = response["run_result"]
    if response.get("status") == "SandboxError" or run.get("status") == "Error":
        raise SandboxServiceError(f"the sandbox failed: {response.get('message') or run.get('stderr')}")
    stdout, stderr, exit_code = run.get("stdout") or "", run.get("stderr") or "", run.get("return_code")
    stopped: StopReason | None
    if "stopped" in response:
        stopped = response["stopped"]
    elif run.get("status") == "TimeLimitExceeded":
        stopped = "wall_time"
    else:
        stopped = None if exit_code == 0 else stderr_stop_reason(stderr)
    return SandboxResult(stdout, stderr, exit_code, stopped)


def run_remote(code: str, limits: SandboxLimits, service: SandboxService) -> SandboxResult:
    """Run ``code`` on ``service`` within ``limits`` and return the result, as :func:`run_sandboxed` locally.

    A connection error or a 5xx is retried ``service.retries`` times, waiting BACKOFF_S, then twice as
    long each time; a request past ``service.timeout_s`` is not retried (the code may still be running
    there). Raises SandboxServiceError when no result comes.
    """
    body = json.dumps(run_code_request(code, limits)).encode()
    headers = {"Content-Type": "application/json"}
    if service.api_key:
        headers["Authorization"] = f"Bearer {service.api_key}"
    url = service.url.rstrip("/") + "/run_code"
    for attempt in range(service.retries):
        try:
            return result_of_response(_post(url, body, headers, service.timeout_s))
        except _Retryable:
            time.sleep(min(BACKOFF_S * 2**attempt, MAX_BACKOFF_S))
    try:
        return result_of_response(_post(url, body, headers, service.timeout_s))
    except _Retryable as exc:
        raise SandboxServiceError(f"{url}: {exc} (after {service.retries} retries)") from exc


class _Retryable(Exception):
    """A failure worth another try: the service was unreachable or failed on its side (5xx)."""


def _post(url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> Any:
    """The JSON body of the answer to POST ``body``; _Retryable or SandboxServiceError when there is none."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:500].decode("utf-8", "replace")
        if exc.code >= 500:
            raise _Retryable(f"HTTP {exc.code}: {detail}") from exc
        raise SandboxServiceError(f"{url}: HTTP {exc.code}: {detail}") from exc
    except (TimeoutError, urllib.error.URLError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if isinstance(reason, TimeoutError):
            raise SandboxServiceError(f"{url}: no answer within {timeout_s:g} s") from exc
        raise _Retryable(f"cannot connect: {reason}") from exc
    except (ConnectionError, http.client.HTTPException) as exc:  # dropped mid-answer
        raise _Retryable(f"the connection failed: {exc!r}") from exc
    except json.JSONDecodeError as exc:
        raise SandboxServiceError(f"{url}: the answer is not JSON: {exc}") from exc
