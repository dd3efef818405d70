"""Reference engines for tests: a backend served in this process, or the server in its own process."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from megatron_rl.engines.http_engine import HttpEngine
from megatron_rl.engines.reference.backend import ReferenceBackend
from megatron_rl.engines.reference.engine import ReferenceEngine
from megatron_rl.engines.reference.server import build_server
from megatron_rl.parallel.local_launch import free_port


@contextmanager
def serving(
    backend: ReferenceBackend, name: str = "ref", *, routed_experts_shape: tuple[int, int] | None = None
) -> Iterator[HttpEngine]:
    """``backend`` behind the reference HTTP server on a free port of 127.0.0.1 (a thread of this process);
    ``routed_experts_shape`` (layers, top_k) decodes the routing it returns."""
    port = free_port()
    server = build_server(backend, "127.0.0.1", port)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield HttpEngine(name, "127.0.0.1", port, request_timeout_s=60, routed_experts_shape=routed_experts_shape)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@contextmanager
def reference_process(
    model: Path, log_dir: Path, *, routed_experts_shape: tuple[int, int] | None = None
) -> Iterator[ReferenceEngine]:
    """The reference server started on ``model`` in its own process, healthy; shut down on exit."""
    engine = ReferenceEngine("ref", model, free_port(), log_dir=log_dir, routed_experts_shape=routed_experts_shape)
    engine.start()
    try:
        engine.wait_healthy(120)
        yield engine
    finally:
        engine.shutdown()
