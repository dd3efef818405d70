"""An engine driven over SGLang's HTTP API: shared by the SGLang and the reference engine.

Transport: stdlib ``http.client`` from the caller's thread over a kept-alive
connection of that thread's own (HTTP/1.1, as SGLang's server and the reference
engine speak it; reused by the thread's next request to the same engine address, so
a step's requests do not each pay a connect and a server thread), so concurrency is
the caller's thread count; :class:`HttpEngine` additionally bounds the requests in
flight per engine with a semaphore (``max_concurrent_requests``). A kept-alive
connection the server has closed since (SGLang's server closes idle ones after a few
seconds) is found closed before it is reused, or fails before any answer arrives;
either way the request goes once more over a new connection, never a second time after
an answer began. A connection is dropped after any failure or timeout, and when the
server says it will close it. Every request has a timeout; connection
failures, timeouts, error statuses and answers the protocol does not allow
(malformed JSON, missing fields) raise the :mod:`engine` errors with the
endpoint, the URL and, when the engine process has died, its exit code and
log tail. With an API key every request carries ``Authorization: Bearer <key>``
(:mod:`~megatron_rl.engines.access`); a 401 says the engine refused it.
"""

from __future__ import annotations

import http.client
import json
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from megatron_rl.config.sglang_pin import SGLANG_VERSION
from megatron_rl.engines.access import UNAUTHORIZED_STATUS, authorization_header
from megatron_rl.engines.engine import (
    EngineRequestError,
    EngineResponseError,
    EngineStartupError,
    EngineTimeoutError,
    EngineUnavailableError,
    RolloutEngine,
)
from megatron_rl.engines.protocol import (
    AbortRequest,
    BeginWeightUpdateRequest,
    CheckWeightsRequest,
    DestroyWeightsUpdateGroupRequest,
    EndWeightUpdateRequest,
    GenerateRequest,
    GenerateResult,
    InitWeightsUpdateGroupRequest,
    LoadLoRAAdapterFromTensorsRequest,
    LoadLoRAAdapterRequest,
    LoRAUpdateResult,
    MemoryOccupationRequest,
    PauseGenerationRequest,
    PauseMode,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
)
from megatron_rl.engines.server_process import ServerProcess

CONNECTION_LOSS_SETTLE_S = 2.0
"""Seconds to wait, after a dropped connection, for a dying engine process to report its exit."""
CONTROL_TIMEOUT_S = 600.0
HEALTH_POLL_S = 0.25
KEY_REFUSED = (
    "; the engine refused this run's API key (Authorization: Bearer): an engine of another run, or one started "
    "with another --api-key, listens at that address"
)
NOT_THE_PROTOCOL = (
    f"check that an SGLang {SGLANG_VERSION} server (or the reference engine) is what listens there "
    "(rollout.engine, and the engine's log)"
)


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether an idle kept-alive socket has something to read: the server closed it (or broke the protocol)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def _check_failure_message(body: str) -> str | None:
    """The message of SGLang's ``{"success": false, "message"}`` answer; None for any other body."""
    try:
        answer = json.loads(body)
    except ValueError:
        return None
    if isinstance(answer, dict) and answer.get("success") is False and isinstance(answer.get("message"), str):
        return answer["message"] or "(empty: SGLang's bare assertion, e.g. a compare with no snapshot taken)"
    return None


class HttpEngine(RolloutEngine):
    """An engine at ``http://host:port``, optionally launched and supervised from ``process``.

    ``routed_experts_shape`` = (num_layers, top_k) decodes routing replay buffers in results.
    ``remote_process_report``: for an engine whose process runs elsewhere (e.g. under a Ray
    actor on another node), a function giving :meth:`process_report` there, called with ``settle_s``.
    ``api_key``: sent with every request (SGLang's ``--api-key``); None sends none.
    """

    def __init__(
        self,
        name: str,
        host: str,
        port: int,
        *,
        process: ServerProcess | None = None,
        remote_process_report: Callable[[float], str] | None = None,
        max_concurrent_requests: int = 256,
        request_timeout_s: float = 3600.0,
        routed_experts_shape: tuple[int, int] | None = None,
        api_key: str | None = None,
    ) -> None:
        self.name = name
        self.host, self.port = host, port
        self.base_url = f"http://{host}:{port}"
        self._address = (host, port)
        self._headers = {"Content-Type": "application/json"} | (authorization_header(api_key) if api_key else {})
        self._api_key = api_key
        self.process = process
        self.remote_process_report = remote_process_report
        self.request_timeout_s = request_timeout_s
        self.routed_experts_shape = routed_experts_shape
        self._slots = threading.BoundedSemaphore(max_concurrent_requests)
        self._lock = threading.Lock()
        self._samples_in_flight: dict[str, list[str]] = {}
        self._connections = threading.local()

    def rebind(self, host: str, port: int, remote_process_report: Callable[[float], str] | None = None) -> None:
        """Talk to the engine at ``host:port`` from now on (a restarted engine); requests in flight are not moved.

        ``remote_process_report`` replaces the old one when given (the restarted process has its own report).
        """
        self.base_url = f"http://{host}:{port}"
        self._address = (host, port)
        if remote_process_report is not None:
            self.remote_process_report = remote_process_report

    def process_report(self, settle_s: float = 0.0) -> str:
        """``'; engine process exited with code N; log tail:\n...'`` once the engine process has ended, else ''.

        '' also when the process is unknown (attached without ``process`` or ``remote_process_report``).
        ``settle_s``: after a dropped connection the process may still be exiting; wait that long for it.
        """
        if self.process is None:
            return "" if self.remote_process_report is None else self.remote_process_report(settle_s)
        exit_code = self.process.wait_for_exit(settle_s)
        if exit_code is None:
            return ""
        return f"; engine process exited with code {exit_code}; log tail:\n{self.process.log_tail()}"

    def request(self, endpoint: str, body: dict[str, Any] | None = None, *, timeout_s: float | None = None) -> Any:
        """POST ``body`` (GET when None) to ``endpoint``; the answer decoded by its Content-Type.

        A JSON answer (``application/json``, SGLang's ORJSONResponse) is decoded; any other body is
        returned as text (SGLang answers ``/flush_cache`` in plain text, without a Content-Type);
        an empty body is None.
        """
        url = self.base_url + endpoint
        timeout = timeout_s if timeout_s is not None else CONTROL_TIMEOUT_S
        data = None if body is None else json.dumps(body).encode()
        try:
            status, raw, content_type = self._exchange("GET" if body is None else "POST", endpoint, data, timeout)
        except TimeoutError as error:
            raise EngineTimeoutError(
                f"engine {self.name}: {endpoint} got no answer within {timeout:.0f} s ({url}){self.process_report()}"
            ) from error
        except (http.client.HTTPException, OSError) as error:
            report = self.process_report(settle_s=CONNECTION_LOSS_SETTLE_S)
            hint = report or "; check that the engine runs and listens at that address (its log, the port)"
            raise EngineUnavailableError(f"engine {self.name}: {endpoint} failed at {url}: {error!r}{hint}") from error
        if status >= 400:
            text = raw.decode("utf-8", errors="replace")
            hint = KEY_REFUSED if status == UNAUTHORIZED_STATUS else ""
            raise EngineRequestError(
                f"engine {self.name}: {endpoint} answered HTTP {status} at {url}: {text[:500]}{hint}",
                status=status,
                body=text,
            )
        if not raw.strip():
            return None
        if content_type != "application/json":
            return raw.decode("utf-8", errors="replace")
        try:
            return json.loads(raw)
        except ValueError as error:
            raise EngineResponseError(
                f"engine {self.name}: {endpoint} answered malformed JSON at {url} ({error}): {raw[:300]!r}; "
                f"{NOT_THE_PROTOCOL}"
            ) from error

    def _exchange(self, method: str, endpoint: str, data: bytes | None, timeout: float) -> tuple[int, bytes, str]:
        """(status, body, media type or '') of one request over this thread's connection to the engine.

        Sent a second time, over a new connection, only when a kept-alive connection failed before
        any answer arrived (the server had closed it); any failure drops the connection.
        """
        may_resend = True
        while True:
            connection, reused = self._connection(timeout)
            try:
                connection.request(method, endpoint, body=data, headers=self._headers)
                response = connection.getresponse()
                raw = response.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self._drop_connection()
                if not (reused and may_resend):
                    raise
                may_resend = False
                continue
            except BaseException:
                self._drop_connection()
                raise
            if response.will_close:
                self._drop_connection()
            content_type = response.headers.get_content_type() if response.headers.get("Content-Type") else ""
            return response.status, raw, content_type

    def _connection(self, timeout: float) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection to the engine's current address (new if none, or if the server closed it),
        set to ``timeout``; and whether it served a request before.

        A process forked from one that used this engine starts without connections: the parent's
        thread-local ones come with the fork and hold its sockets, which parent and children would
        otherwise share, reading each other's answers (seen: forked trainer ranks that hung)."""
        held: dict[tuple[str, int], http.client.HTTPConnection] | None = getattr(self._connections, "held", None)
        if held is None or self._connections.pid != os.getpid():
            held = self._connections.held = {}
            self._connections.pid = os.getpid()
        for stale in [address for address in held if address != self._address]:  # the engine was rebound
            held.pop(stale).close()
        connection = held.get(self._address)
        if connection is not None and connection.sock is not None and _closed_by_peer(connection.sock):
            self._drop_connection()
            connection = None
        reused = connection is not None and connection.sock is not None
        if connection is None:
            connection = http.client.HTTPConnection(*self._address, timeout=timeout)
            held[self._address] = connection
        connection.timeout = timeout
        if connection.sock is not None:
            connection.sock.settimeout(timeout)
        return connection, reused

    def _drop_connection(self) -> None:
        """Close and forget this thread's connection to the engine's current address."""
        connection = (getattr(self._connections, "held", None) or {}).pop(self._address, None)
        if connection is not None:
            connection.close()

    def start(self) -> None:
        if self.process is None:
            raise EngineStartupError(f"engine {self.name} has no process to start (attached to {self.base_url})")
        self.process.start()

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self.process is not None and self.process.exit_code is not None:
                raise EngineStartupError(f"engine {self.name} exited before becoming healthy{self.process_report()}")
            try:
                self.request("/health", timeout_s=max(1.0, min(5.0, deadline - time.monotonic())))
                return
            except (EngineUnavailableError, EngineTimeoutError, EngineRequestError) as error:
                last_error = error
            time.sleep(HEALTH_POLL_S)
        raise EngineStartupError(
            f"engine {self.name} not healthy at {self.base_url} after {timeout_s:.0f} s (last error: {last_error})"
            f"{self.process_report()}"
        )

    def discard_start_secrets(self) -> None:
        """Delete what the server process read at start and needs no more, once the engine is healthy (for a
        node process of an engine spanning nodes: once node 0 is). Nothing here: the reference server gets its
        key in its environment."""

    def generate(self, request: GenerateRequest, *, timeout_s: float | None = None) -> list[GenerateResult]:
        key, sample_rids = request.rid if isinstance(request.rid, str) else None, request.sample_rids()
        if key is not None and sample_rids is not None:
            with self._lock:
                self._samples_in_flight[key] = sample_rids
        try:
            with self._slots:
                answer = self.request("/generate", request.to_json(), timeout_s=timeout_s or self.request_timeout_s)
        finally:
            if key is not None:
                with self._lock:
                    self._samples_in_flight.pop(key, None)
        samples = answer if isinstance(answer, list) else [answer]
        try:
            return [GenerateResult.from_json(s, routed_experts_shape=self.routed_experts_shape) for s in samples]
        except (KeyError, TypeError, ValueError, IndexError) as error:
            what = f"no field {error.args[0]!r}" if isinstance(error, KeyError) else f"{type(error).__name__}: {error}"
            raise EngineResponseError(
                f"engine {self.name}: /generate at {self.base_url} answered a sample the protocol does not allow "
                f"({what}): {json.dumps(answer)[:300]}; {NOT_THE_PROTOCOL}"
            ) from error

    def abort(self, rid: str | None = None) -> None:
        """Abort the request ``rid`` names: each of its samples' ids (``GenerateRequest.sample_rids``)."""
        if rid is None:
            self.request("/abort_request", AbortRequest(abort_all=True).to_json())
            return
        with self._lock:
            sample_rids = self._samples_in_flight.get(rid, [rid])
        for sample_rid in sample_rids:
            self.request("/abort_request", AbortRequest(rid=sample_rid).to_json())

    def pause_generation(self, mode: PauseMode = "retract") -> None:
        self.request("/pause_generation", PauseGenerationRequest(mode=mode).to_json())

    def continue_generation(self) -> None:
        self.request("/continue_generation", {})

    def flush_cache(self) -> None:
        self.request("/flush_cache", {})

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        self.request("/release_memory_occupation", MemoryOccupationRequest(list(tags) if tags else None).to_json())

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        self.request("/resume_memory_occupation", MemoryOccupationRequest(list(tags) if tags else None).to_json())

    def begin_weight_update(self) -> None:
        self.request("/begin_weight_update", BeginWeightUpdateRequest().to_json())

    def end_weight_update(self) -> None:
        self.request("/end_weight_update", EndWeightUpdateRequest().to_json())

    def update_weights_from_tensor(self, request: UpdateWeightsFromTensorRequest) -> None:
        self.request("/update_weights_from_tensor", request.to_json())

    def init_weights_update_group(self, request: InitWeightsUpdateGroupRequest) -> None:
        self.request("/init_weights_update_group", request.to_json())

    def destroy_weights_update_group(self, group_name: str) -> None:
        self.request("/destroy_weights_update_group", DestroyWeightsUpdateGroupRequest(group_name).to_json())

    def update_weights_from_distributed(self, request: UpdateWeightsFromDistributedRequest) -> None:
        self.request("/update_weights_from_distributed", request.to_json())

    def update_weights_from_disk(self, request: UpdateWeightsFromDiskRequest) -> None:
        self.request("/update_weights_from_disk", request.to_json())

    def load_lora_adapter_from_tensors(self, request: LoadLoRAAdapterFromTensorsRequest) -> LoRAUpdateResult:
        """Register a LoRA adapter from tensors; the engine's adapters after it. A refusal (duplicate name, rank or
        targets the engine was not started for, LoRA not enabled) raises EngineRequestError, status 400, whose
        ``body`` is :class:`LoRAUpdateResult` JSON with SGLang's ``error_message``."""
        return LoRAUpdateResult.from_json(self.request("/load_lora_adapter_from_tensors", request.to_json()))

    def load_lora_adapter(self, request: LoadLoRAAdapterRequest) -> LoRAUpdateResult:
        """Register a LoRA adapter from a PEFT directory the engine reads; refusals as
        :meth:`load_lora_adapter_from_tensors`."""
        return LoRAUpdateResult.from_json(self.request("/load_lora_adapter", request.to_json()))

    def unload_lora_adapter(self, lora_name: str) -> LoRAUpdateResult:
        """Forget adapter ``lora_name``; an unknown name raises EngineRequestError (400, :class:`LoRAUpdateResult`
        JSON)."""
        return LoRAUpdateResult.from_json(
            self.request("/unload_lora_adapter", UnloadLoRAAdapterRequest(lora_name).to_json())
        )

    def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> None:
        """Report ``new_version`` as the weight version of generation results from now on (SGLang's
        ``/update_weight_version``; the weights stay). ``abort_all_requests``: abort every request in flight first
        (SGLang's default for the endpoint, not ours)."""
        self.request("/update_weight_version", UpdateWeightVersionRequest(new_version, abort_all_requests).to_json())

    def check_weights(
        self, action: str, *, allow_quant_error: bool = False, skip_tensor_list: list[str] | None = None
    ) -> dict[str, Any]:
        request = CheckWeightsRequest(action, allow_quant_error, skip_tensor_list)
        try:
            answer: dict[str, Any] = self.request("/weights_checker", request.to_json())
            return answer
        except EngineRequestError as error:
            message = _check_failure_message(error.body)
            if message is None:
                raise
            # the whole message: request() cuts the body at 500 characters, a compare names every differing tensor
            raise EngineRequestError(
                f"engine {self.name}: /weights_checker {action} failed (HTTP {error.status}): {message}",
                status=error.status,
                body=error.body,
            ) from error

    def shutdown(self) -> None:
        if self.process is not None:
            self.process.stop()
