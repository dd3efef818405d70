"""SGLang 0.5.23's own HTTP layer (``sglang.srt.entrypoints.http_server.app``) in front of our reference backend.

SGLang's FastAPI app turns each request into its own request type (pydantic
over its msgspec structs, exactly as in production), calls its tokenizer
manager, and maps the answer to status codes and bodies (plain-text
``/flush_cache``, ``{"success", "message"}`` with 400 for refused weight
updates, Starlette's 500 for an assertion). :class:`ReferenceTokenizerManager`
stands in for the tokenizer manager + scheduler: each method SGLang's routes
await is answered by :class:`~megatron_rl.engines.reference.backend.ReferenceBackend`
(run in a thread, so a blocking group join or broadcast does not stall the
event loop), returning what SGLang's manager returns. So our client talks to
SGLang's real routes, and the reference backend plays SGLang's scheduler.

With ``api_key``, the app is wrapped in SGLang's own API-key middleware
(``sglang.srt.utils.auth.add_api_key_middleware``, what its ``launch_server`` adds
for ``--api-key``), built around the app without changing it.

Needs ``sglang`` importable with the HTTP modules of
``tests/sglang_protocol_requirements.txt`` (fastapi, uvicorn, uvloop, ...).
"""

from __future__ import annotations

import asyncio
import base64
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from megatron_rl.engines.protocol import (
    GenerateRequest,
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDistributedRequest,
)
from megatron_rl.engines.reference.backend import EngineStateError, ReferenceBackend, WeightUpdateRefused
from megatron_rl.parallel.local_launch import free_port

STARTUP_TIMEOUT_S = 30.0


def _success(call: Callable[[], Any]) -> tuple[bool, str]:
    try:
        call()
    except WeightUpdateRefused as refused:
        return False, str(refused)
    return True, "Success"


class ReferenceTokenizerManager:
    """The methods and attributes SGLang's routes use, answered by a :class:`ReferenceBackend`."""

    is_generation = True
    gracefully_exit = False

    def __init__(self, backend: ReferenceBackend) -> None:
        from sglang.srt.managers.tokenizer_manager import ServerStatus

        self.backend = backend
        self.server_status = ServerStatus.Up
        self.last_receive_tstamp = time.time()

    async def _run(self, call: Callable[[], Any]) -> Any:
        return await asyncio.to_thread(call)

    async def generate_request(self, obj, request=None) -> AsyncIterator[Any]:
        body = {
            "input_ids": obj.input_ids,
            "sampling_params": obj.sampling_params or {},
            "rid": obj.rid,
            "return_logprob": obj.return_logprob,
            "logprob_start_len": obj.logprob_start_len,
            "return_routed_experts": obj.return_routed_experts,
            "routed_experts_start_len": obj.routed_experts_start_len,
            "stream": obj.stream,
        }
        try:
            answer = await self._run(lambda: self.backend.generate(GenerateRequest.from_json(body)))
        except EngineStateError as error:
            raise ValueError(str(error)) from error
        yield answer

    async def flush_cache(self, timeout_s: float | None = None):
        from sglang.srt.managers.io_struct import FlushCacheReqOutput

        return FlushCacheReqOutput(success=await self._run(lambda: self.backend.flush_cache(timeout_s or 0.0)))

    async def begin_weight_update(self, obj, request=None) -> tuple[bool, str]:
        return await self._run(lambda: _success(self.backend.begin_weight_update))

    async def end_weight_update(self, obj, request=None) -> tuple[bool, str]:
        return await self._run(lambda: _success(self.backend.end_weight_update))

    async def update_weights_from_tensor(self, obj, request=None) -> tuple[bool, str]:
        """SGLang's HTTP layer decoded each base64 payload to bytes; our backend takes base64, as on the wire."""
        return await self._run(
            lambda: _success(
                lambda: self.backend.update_from_tensor(
                    [base64.b64encode(raw).decode("ascii") for raw in obj.serialized_named_tensors],
                    obj.weight_version,
                    obj.flush_cache,
                    obj.load_format,
                )
            )
        )

    async def init_weights_update_group(self, obj, request=None) -> tuple[bool, str]:
        ours = InitWeightsUpdateGroupRequest(
            obj.master_address, obj.master_port, obj.rank_offset, obj.world_size, obj.group_name, obj.backend
        )
        return await self._run(lambda: _success(lambda: self.backend.init_group(ours)))

    async def destroy_weights_update_group(self, obj, request=None) -> tuple[bool, str]:
        return await self._run(lambda: _success(lambda: self.backend.destroy_group(obj.group_name)))

    async def update_weights_from_distributed(self, obj, request=None) -> tuple[bool, str]:
        ours = UpdateWeightsFromDistributedRequest(
            list(obj.names),
            [str(d) for d in obj.dtypes],
            [list(s) for s in obj.shapes],
            obj.group_name,
            obj.flush_cache,
            weight_version=obj.weight_version,
            load_format=obj.load_format,
        )
        return await self._run(lambda: _success(lambda: self.backend.update_from_distributed(ours)))

    async def update_weights_from_disk(self, obj, request=None) -> tuple[bool, str, int]:
        success, message = await self._run(
            lambda: _success(lambda: self.backend.update_from_disk(obj.model_path, obj.weight_version, obj.flush_cache))
        )
        return success, message, 0

    async def pause_generation(self, obj) -> None:
        await self._run(lambda: self.backend.pause(obj.mode))

    async def continue_generation(self, obj) -> None:
        await self._run(self.backend.resume_generation)

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.backend.abort(rid, abort_all)

    async def release_memory_occupation(self, obj, request=None) -> None:
        await self._run(lambda: self.backend.release(obj.tags))

    async def resume_memory_occupation(self, obj, request=None) -> None:
        await self._run(lambda: self.backend.resume(obj.tags))

    async def get_weights_by_name(self, obj, request=None) -> list:
        return await self._run(lambda: self.backend.weights_by_name(obj.name, obj.truncate_size))


class _MiddlewareCapture:
    """Stands in for the app in ``add_api_key_middleware``: records the middleware SGLang would add.

    The module-level app may have served requests already, after which Starlette refuses new
    middleware; the captured class is instead instantiated around the app (what Starlette does).
    """

    def __init__(self, app: Any) -> None:
        self.router = app.router
        self.routes = app.routes
        self.added: tuple[type, dict[str, Any]] | None = None

    def add_middleware(self, cls: type, **kwargs: Any) -> None:
        self.added = (cls, kwargs)


def with_sglang_api_key(app: Any, api_key: str) -> Any:
    """``app`` behind SGLang's API-key middleware for ``--api-key api_key`` (no admin key)."""
    from sglang.srt.utils.auth import add_api_key_middleware

    capture = _MiddlewareCapture(app)
    add_api_key_middleware(capture, api_key=api_key, admin_api_key=None)
    assert capture.added is not None, "SGLang added no API-key middleware"
    cls, kwargs = capture.added
    return cls(app, **(kwargs | {"fastapi_app": app}))


@contextmanager
def serve_sglang_http(backend: ReferenceBackend, *, api_key: str | None = None) -> Iterator[int]:
    """SGLang's FastAPI app on 127.0.0.1 (uvicorn, in a thread) over ``backend``; yields the port.

    ``api_key``: requests need it, as on a server started with ``--api-key``.
    """
    import uvicorn
    from sglang.srt.entrypoints import http_server

    os.environ["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] = "false"  # /health answers 200 without a generation
    http_server.set_global_state(
        http_server._GlobalState(
            tokenizer_manager=ReferenceTokenizerManager(backend), template_manager=None, scheduler_info={}
        )
    )
    port = free_port()
    app = http_server.app if api_key is None else with_sglang_api_key(http_server.app, api_key)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, name="sglang-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("SGLang's HTTP app did not start")
        time.sleep(0.05)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(STARTUP_TIMEOUT_S)
