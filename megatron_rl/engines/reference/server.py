"""The reference engine's HTTP server: SGLang's RL subset, same JSON shapes, plain PyTorch behind it.

Run ``python -m megatron_rl.engines.reference.server --model-path DIR --port P``
(binds 127.0.0.1 unless ``--host`` names another address; a wildcard such as
``0.0.0.0`` is refused). An engine of several node processes takes SGLang's
``--nnodes N --node-rank k --dist-init-addr HOST:PORT`` (:mod:`node_group`; only
node rank 0 serves HTTP). ``--load-format dummy`` initialises random weights from
``DIR/config.json`` (as SGLang's dummy format), for engines that will receive
their weights from the trainer.

API key: with ``--api-key KEY`` or, as our launcher passes it (a command line is
readable by anyone on the node), the environment variable
``MEGATRON_RL_ENGINE_API_KEY``, requests are checked exactly as SGLang 0.5.23
checks them with ``--api-key`` (:func:`megatron_rl.engines.access.is_authorized`):
``/health*`` (and ``/ready*``, ``/metrics*``) open, every other path, unknown
ones included, needs ``Authorization: Bearer KEY``; otherwise 401 with
``{"error":"Unauthorized"}``, before the body is parsed or the route looked up.

Status codes and bodies follow SGLang 0.5.23 (``srt/entrypoints/http_server.py``):
200 on success; 400 with ``{"error": {"message"}}`` for a malformed request or
one the current state refuses; 400 with ``{"success": false, "message"}`` for a
refused weight-update request (outside a session, a second session, an
unknown group, an update whose flush was refused) and for a failed ``/weights_checker``
action (:mod:`~megatron_rl.engines.reference.weight_checker`); ``/flush_cache`` in plain
text without a Content-Type (200 ``FLUSH_CACHE_OK``, 400 ``FLUSH_CACHE_FAILED``;
``?timeout=S`` waits up to S seconds for idle); 500 ``Internal Server Error`` in
plain text for an unexpected failure, the ``dp_size == 1`` assertion included
(``--dp-size``); 404 for an unknown endpoint. ``/health`` answers 200 once the
model is loaded (the socket is only opened then).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import torch

from megatron_rl.config.fp8_checkpoint import checkpoint_block
from megatron_rl.engines.access import (
    API_KEY_ENV,
    UNAUTHORIZED_BODY,
    UNAUTHORIZED_STATUS,
    check_listen_host,
    is_authorized,
)
from megatron_rl.engines.protocol import (
    FLUSH_CACHE_FAILED,
    FLUSH_CACHE_OK,
    FORWARD_SECONDS_METRIC,
    IDLE_SECONDS_METRIC,
    AbortRequest,
    BeginWeightUpdateRequest,
    CheckWeightsRequest,
    DestroyWeightsUpdateGroupRequest,
    EndWeightUpdateRequest,
    GenerateRequest,
    GetWeightsByNameRequest,
    InitWeightsUpdateGroupRequest,
    LoadLoRAAdapterFromTensorsRequest,
    LoadLoRAAdapterRequest,
    LoRASettings,
    MemoryOccupationRequest,
    PauseGenerationRequest,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
)
from megatron_rl.engines.reference.backend import (
    DEFAULT_MAX_RUNNING_REQUESTS,
    EngineStateError,
    ReferenceBackend,
    WeightUpdateRefused,
)
from megatron_rl.engines.reference.fault_injection import exit_at_start_if_asked, exit_if_asked
from megatron_rl.engines.reference.lora_adapters import LoRAUpdateFailed
from megatron_rl.engines.reference.weight_checker import WeightCheckFailed
from megatron_rl.parallel.device import select_device

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

Route = Callable[[ReferenceBackend, dict[str, Any]], Any]
_OK = {"success": True, "message": "Success"}


@dataclass(frozen=True)
class TextReply:
    """A plain-text answer, without a Content-Type unless given (SGLang's ``Response(content=...)``)."""

    text: str
    status: int = 200
    content_type: str | None = None


PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""What prometheus_client's ASGI app (SGLang's ``/metrics``) answers with."""


def prometheus_metrics(backend: ReferenceBackend) -> str:
    """SGLang's forward-time and scheduler-idle counters in Prometheus' text format.

    SGLang (``--enable-metrics``, ``srt/observability/metrics_collector.py``) counts
    ``sglang:forward_execution_seconds_total``, the seconds its device executes forward passes,
    labelled by forward mode (``extend``: a prefill is in the batch; ``decode``), and
    ``sglang:scheduler_idle_seconds_total``, the wall seconds its scheduler had no request. The
    reference engine counts the wall seconds of its forward calls and of its scheduler's waits
    with no request; labels as SGLang's for one TP/PP/EP rank.
    """
    rank = f'model_name="{backend.model.config.name_or_path}",tp_rank="0",pp_rank="0",moe_ep_rank="0"'
    lines = [
        f"# HELP {FORWARD_SECONDS_METRIC} Total time that GPU is busy executing model forward passes. "
        "Refer to ForwardMode for category labels.",
        f"# TYPE {FORWARD_SECONDS_METRIC} counter",
    ]
    for category, seconds in backend.slot_model.forward_seconds.items():
        lines.append(f'{FORWARD_SECONDS_METRIC}{{{rank},category="{category}"}} {seconds!r}')
    lines += [
        f"# HELP {IDLE_SECONDS_METRIC} Total wall time while the scheduler has no runnable or queued work.",
        f"# TYPE {IDLE_SECONDS_METRIC} counter",
        f"{IDLE_SECONDS_METRIC}{{{rank}}} {backend.idle_seconds!r}",
    ]
    return "\n".join(lines) + "\n"


def _flush(backend: ReferenceBackend, query: dict[str, list[str]]) -> TextReply:
    timeout_s = float(query.get("timeout", ["0"])[0])
    if timeout_s < 0:
        raise ValueError(f"timeout must be >= 0, got {timeout_s}")
    if backend.flush_cache(timeout_s):
        return TextReply(FLUSH_CACHE_OK)
    return TextReply(FLUSH_CACHE_FAILED, 400)


def _update(fn: Callable[[ReferenceBackend, Any], None], parse: Callable[[dict[str, Any]], Any]) -> Route:
    def route(backend: ReferenceBackend, body: dict[str, Any]) -> dict[str, Any]:
        fn(backend, parse(body))
        return _OK

    return route


def _generate(backend: ReferenceBackend, body: dict[str, Any]) -> Any:
    exit_if_asked()
    return backend.generate(GenerateRequest.from_json(body))


ROUTES: dict[str, Route] = {
    "/health": lambda b, body: None,
    "/health_generate": lambda b, body: None,
    "/model_info": lambda b, body: {"model_path": b.model.config.name_or_path, "weight_version": b.weight_version},
    "/generate": _generate,
    "/abort_request": lambda b, body: b.abort(**AbortRequest.from_json(body).to_json()),
    "/pause_generation": lambda b, body: b.pause(PauseGenerationRequest.from_json(body).mode),
    "/continue_generation": lambda b, body: b.resume_generation(),
    "/release_memory_occupation": lambda b, body: b.release(MemoryOccupationRequest.from_json(body).tags),
    "/resume_memory_occupation": lambda b, body: b.resume(MemoryOccupationRequest.from_json(body).tags),
    "/get_weights_by_name": lambda b, body: b.weights_by_name(**GetWeightsByNameRequest.from_json(body).to_json()),
    "/weights_checker": lambda b, body: b.check_weights(CheckWeightsRequest.from_json(body)),
    "/begin_weight_update": _update(lambda b, r: b.begin_weight_update(), BeginWeightUpdateRequest.from_json),
    "/end_weight_update": _update(lambda b, r: b.end_weight_update(), EndWeightUpdateRequest.from_json),
    "/update_weights_from_tensor": _update(
        lambda b, r: b.update_from_tensor(r.serialized_named_tensors, r.weight_version, r.flush_cache, r.load_format),
        UpdateWeightsFromTensorRequest.from_json,
    ),
    "/init_weights_update_group": _update(ReferenceBackend.init_group, InitWeightsUpdateGroupRequest.from_json),
    "/destroy_weights_update_group": _update(
        lambda b, r: b.destroy_group(r.group_name), DestroyWeightsUpdateGroupRequest.from_json
    ),
    "/update_weights_from_distributed": _update(
        ReferenceBackend.update_from_distributed, UpdateWeightsFromDistributedRequest.from_json
    ),
    "/load_lora_adapter_from_tensors": lambda b, body: b.load_lora_from_tensors(
        LoadLoRAAdapterFromTensorsRequest.from_json(body)
    ),
    "/load_lora_adapter": lambda b, body: b.load_lora_from_path(LoadLoRAAdapterRequest.from_json(body)),
    "/unload_lora_adapter": lambda b, body: b.unload_lora(UnloadLoRAAdapterRequest.from_json(body).lora_name),
    "/update_weight_version": lambda b, body: b.update_weight_version(UpdateWeightVersionRequest.from_json(body)),
    "/update_weights_from_disk": _update(
        lambda b, r: b.update_from_disk(r.model_path, r.weight_version, r.flush_cache),
        UpdateWeightsFromDiskRequest.from_json,
    ),
}
QUERY_ROUTES: dict[str, Callable[[ReferenceBackend, dict[str, list[str]]], Any]] = {
    "/flush_cache": _flush,
    "/metrics": lambda b, query: TextReply(prometheus_metrics(b), content_type=PROMETHEUS_CONTENT_TYPE),
}
"""Endpoints whose arguments are query parameters (SGLang's ``/flush_cache?timeout=S``), GET or POST."""
_UPDATE_ROUTES = frozenset(
    r for r in ROUTES if r.startswith(("/update_", "/init_weights", "/destroy_weights", "/begin_weight", "/end_weight"))
)


Answer = tuple[int, Any]
"""(HTTP status, payload): a JSON value, a :class:`TextReply` or None (an empty body)."""
Router = Callable[[str, str, dict[str, Any]], Answer]
"""What answers a request: (path, query string, JSON body) in, :data:`Answer` out."""


def answer(backend: ReferenceBackend, path: str, query: str, body: dict[str, Any]) -> Answer:
    """The answer of ``backend`` to one request, with SGLang's status codes and bodies (module docstring)."""
    if path not in ROUTES and path not in QUERY_ROUTES:
        return 404, {"error": {"message": f"unknown endpoint {path}", "code": 404}}
    try:
        if path in QUERY_ROUTES:
            return 200, QUERY_ROUTES[path](backend, parse_qs(query))
        return 200, ROUTES[path](backend, body)
    except LoRAUpdateFailed as error:  # SGLang answers LoRAUpdateOutput with 400 (http_server.py:1652-1684)
        return 400, error.result.to_json()
    except (WeightUpdateRefused, WeightCheckFailed) as error:
        return 400, {"success": False, "message": str(error)}
    except (ValueError, TypeError, KeyError, EngineStateError) as error:
        message = f"{type(error).__name__}: {error}"
        if path in _UPDATE_ROUTES:
            return 400, {"success": False, "message": message}
        return 400, {"error": {"message": message, "code": 400}}
    except Exception:  # noqa: BLE001 - the server must answer, whatever failed (SGLang: Starlette's 500)
        logger.error("%s failed:\n%s", path, traceback.format_exc())
        return 500, TextReply("Internal Server Error", 500)


class _Handler(BaseHTTPRequestHandler):
    router: Router
    api_key: str | None = None
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    """TCP_NODELAY, as SGLang's server (uvicorn on asyncio) sets it: on a kept-alive connection an answer's
    headers and body go out at once instead of waiting for the client's delayed ACK (about 40 ms)."""

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s " + format, self.address_string(), *args)

    def _reply(self, status: int, payload: Any) -> None:
        if isinstance(payload, TextReply):
            status, data = payload.status, payload.text.encode()
        else:
            data = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(status)
        if not isinstance(payload, TextReply):
            self.send_header("Content-Type", "application/json")
        elif payload.content_type is not None:
            self.send_header("Content-Type", payload.content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        """Whether the request may proceed; if not, the 401 SGLang answers has been sent."""
        path = self.path.partition("?")[0]
        if is_authorized(self.command, path, self.headers.get("Authorization"), self.api_key):
            return True
        self.send_response(UNAUTHORIZED_STATUS)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(UNAUTHORIZED_BODY)))
        self.end_headers()
        self.wfile.write(UNAUTHORIZED_BODY)
        return False

    def _dispatch(self, body: dict[str, Any]) -> None:
        path, _, query = self.path.partition("?")
        self._reply(*self.router(path, query, body))

    def do_GET(self) -> None:
        if self._authorized():
            self._dispatch({})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not self._authorized():
            return
        try:
            body = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as error:
            self._reply(400, {"error": {"message": f"body is not JSON: {error}", "code": 400}})
            return
        if not isinstance(body, dict):
            self._reply(400, {"error": {"message": "body must be a JSON object", "code": 400}})
            return
        self._dispatch(body)


class _Server(ThreadingHTTPServer):
    """Accepts as many pending connections as clients keep in flight (the default backlog of 5 resets the rest)."""

    request_queue_size = 1024
    daemon_threads = True


def build_server(
    backend: ReferenceBackend, host: str, port: int, *, api_key: str | None = None, router: Router | None = None
) -> ThreadingHTTPServer:
    """A threading HTTP server bound to ``host:port`` serving ``backend`` (call ``serve_forever``).

    ``api_key``: requests need it as SGLang's ``--api-key`` does (module docstring); None: no check.
    ``router``: what answers requests (default :func:`answer` on ``backend``; an engine of several
    nodes passes its :meth:`~megatron_rl.engines.reference.node_group.NodeGroup.answer`).
    Raises ValueError for a wildcard ``host`` (every interface).
    """
    route = router or functools.partial(answer, backend)
    handler = type("ReferenceHandler", (_Handler,), {"router": staticmethod(route), "api_key": api_key or None})
    return _Server((check_listen_host(host), port), handler)


def load_model(model_path: str, load_format: str, dtype: torch.dtype, device: str) -> PreTrainedModel:
    """The transformers causal LM of ``model_path`` on ``device`` (``dummy``: random weights from its config.json,
    initialised on ``device`` itself: on a GPU a 3.2B-parameter model started in seconds instead of 115 s). An
    FP8 checkpoint gives random weights too: its weights go through :meth:`ReferenceBackend.update_from_disk`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (Path(model_path) / "config.json").is_file():
        raise FileNotFoundError(f"--model-path {model_path}: no config.json (a local Hugging Face directory is needed)")
    if load_format == "dummy" or fp8_block_of(model_path) is not None:
        config = AutoConfig.from_pretrained(model_path)
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the engine computes in `dtype` from the FP8 weights it keeps
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    placed: PreTrainedModel = model.to(device)
    return placed


def fp8_block_of(model_path: str) -> tuple[int, int] | None:
    """The FP8 block of the checkpoint at ``model_path``; None when it is not FP8 (ValueError for another
    quantisation)."""
    return checkpoint_block(json.loads((Path(model_path) / "config.json").read_text()))


def _exit_when_orphaned(interval_s: float = 1.0) -> None:
    """End this process once its parent is gone (e.g. a driver killed with SIGKILL), not to linger holding memory."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        logger.info("parent process %d is gone; exiting", parent)
        os._exit(0)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1", help="the one address to listen on (no wildcard)")
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' as SGLang's --api-key does (default: ${API_KEY_ENV}; prefer it, "
        "a command line is visible to every user of the node)",
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--load-format", choices=("auto", "dummy"), default="auto")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--device", default=select_device().type)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads on CPU")
    parser.add_argument(
        "--dp-size", type=int, default=1, help="claimed data-parallel size; > 1 fails weight updates as SGLang does"
    )
    parser.add_argument(
        "--max-running-requests",
        type=int,
        default=DEFAULT_MAX_RUNNING_REQUESTS,
        help="samples decoding at once (KV cache slots); more wait",
    )
    parser.add_argument("--context-length", type=int, default=None, help="default: the model's max_position_embeddings")
    parser.add_argument("--nnodes", type=int, default=1, help="node processes of the engine (SGLang's --nnodes)")
    parser.add_argument("--node-rank", type=int, default=0, help="this process's node (0 serves HTTP)")
    parser.add_argument("--dist-init-addr", default=None, help="host:port of node 0's node-group store")
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (SGLang's flag)")
    parser.add_argument("--max-lora-rank", type=int, default=None, help="the largest adapter rank accepted")
    parser.add_argument("--lora-target-modules", nargs="+", default=None, help="projections adapters may target")
    parser.add_argument(
        "--max-loras-per-batch",
        type=int,
        default=8,
        help="SGLang's adapter slots per batch; accepted, not needed here (any adapters share a step; same outputs)",
    )
    args = parser.parse_args(argv)
    if args.enable_lora and (args.max_lora_rank is None or not args.lora_target_modules):
        parser.error("--enable-lora needs --max-lora-rank and --lora-target-modules (as SGLang without --lora-paths)")
    if args.nnodes > 1 and not args.dist_init_addr:
        parser.error("--nnodes > 1 needs --dist-init-addr (host:port of node rank 0)")
    exit_at_start_if_asked()
    api_key = args.api_key or os.environ.pop(API_KEY_ENV, None) or None
    check_listen_host(args.host)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s reference-engine %(levelname)s %(message)s")
    torch.set_num_threads(args.num_threads)
    _exit_when_orphaned()
    model = load_model(args.model_path, args.load_format, getattr(torch, args.dtype), args.device)
    fp8_block = fp8_block_of(args.model_path)
    backend = ReferenceBackend(
        model,
        seed=args.seed,
        dp_size=args.dp_size,
        max_running_requests=args.max_running_requests,
        context_length=args.context_length,
        fp8_block=fp8_block,
        tp_rank=args.node_rank,
        tp_size=args.nnodes,
        lora=(
            LoRASettings(args.max_lora_rank, tuple(args.lora_target_modules), args.max_loras_per_batch)
            if args.enable_lora
            else None
        ),
    )
    if fp8_block is not None and args.load_format != "dummy":
        backend.update_from_disk(args.model_path, version=None)
    router = None
    if args.nnodes > 1:
        from megatron_rl.engines.reference import node_group  # imports this module: only engines of several nodes

        node_group.join_nodes(args.dist_init_addr, args.nnodes, args.node_rank)
        if args.node_rank > 0:
            node_group.serve_node(backend, answer)
            return
        router = node_group.NodeGroup(backend, args.nnodes, answer).answer
    server = build_server(backend, args.host, args.port, api_key=api_key, router=router)
    logger.info(
        "serving %s on http://%s:%d (%s)",
        args.model_path,
        args.host,
        args.port,
        "API key required" if api_key else "no API key",
    )
    server.serve_forever()


if __name__ == "__main__":
    main()
