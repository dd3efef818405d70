"""A stand-in engine server that answers every request from a function: canned answers, bad ones included.

:func:`canned_engine` serves ``answer(path, body) -> (status, content_type, payload)`` on a free
loopback port in a thread, so the real :class:`~megatron_rl.rollout.HttpEngine` client can be
driven against well-formed results (reward tests) and against malformed ones (bad-input tests).
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from megatron_rl.engines import HttpEngine

Answer = Callable[[str, Any], tuple[int, str, bytes]]


def json_answer(body: Any, status: int = 200) -> tuple[int, str, bytes]:
    """``body`` as an ``application/json`` answer."""
    return status, "application/json", json.dumps(body).encode()


def sample(output_ids: list[int], rid: str) -> dict[str, Any]:
    """One well-formed ``/generate`` sample, as SGLang 0.5.23 answers it (log-prob -0.5 per token)."""
    return {
        "text": "",
        "output_ids": output_ids,
        "meta_info": {
            "id": rid,
            "finish_reason": {"type": "stop", "matched": output_ids[-1]},
            "prompt_tokens": 2,
            "completion_tokens": len(output_ids),
            "cached_tokens": 0,
            "weight_version": "0",
            "output_token_logprobs": [[-0.5, token, None] for token in output_ids],
        },
    }


@contextmanager
def canned_engine(answer: Answer, *, request_timeout_s: float = 30.0) -> Iterator[HttpEngine]:
    """An :class:`HttpEngine` named ``canned`` whose server answers each request with ``answer``."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def _reply(self, body: Any) -> None:
            status, content_type, payload = answer(self.path, body)
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self._reply(None)

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length", 0))
            self._reply(json.loads(self.rfile.read(length) or b"null"))

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield HttpEngine("canned", "127.0.0.1", server.server_address[1], request_timeout_s=request_timeout_s)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
