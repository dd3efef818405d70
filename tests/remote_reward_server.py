"""A real reward server for tests, in slime's ``--rm-url`` shapes: JSON ``{"prompt", "response", "label", ...}``
in, the reward's answer out.

:class:`RewardServer` serves in a thread of the test (HTTP/1.1, kept-alive connections) and records every
request; how it answers is a function of the request (:func:`scored_by`: a registered reward's score, correct
and answer as a JSON object). :meth:`RewardServer.kill` stops it as a crash would: the listening socket and
every open connection closed, mid-use. Run as a process (``python -m tests.remote_reward_server --reward NAME
[--die-after N]``) it prints ``port <n>`` once it listens and, with ``--die-after``, exits abruptly (no answer,
its connections reset) on the request after the N-th.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from megatron_rl.data import get_reward

POLL_S = 0.02
"""Seconds between the server thread's checks for shutdown: a killed server stops within that."""
DROP = 0
"""The status an answerer gives to close the connection without answering (a server dying mid-request)."""
Answerer = Callable[[dict[str, Any], int], tuple[int, bytes]]
"""(request body, its index among the server's requests) -> (HTTP status or DROP, answer body)."""


@dataclass(frozen=True)
class Received:
    """One request as it arrived: method, path, Content-Type and the decoded JSON body."""

    method: str
    path: str
    content_type: str
    body: dict[str, Any]


def json_answer(value: Any, status: int = 200) -> tuple[int, bytes]:
    """``value`` as a JSON answer with ``status``."""
    return status, json.dumps(value).encode()


def scored_by(reward: str) -> Answerer:
    """Answers ``{"score", "correct", "answer"}``: the registered ``reward`` on the request's response and label."""
    fn = get_reward(reward)

    def answer(body: dict[str, Any], index: int) -> tuple[int, bytes]:
        output = fn(body["response"], body["label"], body["metadata"])
        return json_answer({"score": output.score, "correct": output.correct, "answer": output.answer})

    return answer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # kept-alive connections, as a production server keeps them
    disable_nagle_algorithm = True  # headers and body go in two writes: Nagle would hold the body for the ACK
    server: RewardServer

    def setup(self) -> None:
        super().setup()
        self.server.opened(self.connection)

    def finish(self) -> None:
        self.server.closed(self.connection)
        super().finish()

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        body = json.loads(raw)
        index = self.server.record(Received("POST", self.path, self.headers.get("Content-Type", ""), body))
        status, answer = self.server.answer(body, index)
        if status == DROP:
            self.close_connection = True
            return
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: tests read :attr:`RewardServer.received` instead."""


class RewardServer(ThreadingHTTPServer):
    """A reward server on 127.0.0.1 (``port`` 0: a free one) answering with ``answer``; a context manager that
    serves in a daemon thread. ``received`` lists the requests in order; ``connections`` counts the connections
    accepted."""

    daemon_threads = True

    def __init__(self, answer: Answerer | None = None, port: int = 0) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.answer = answer or scored_by("synthetic_successor")
        self.received: list[Received] = []
        self.connections = 0
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def url(self, path: str = "/score") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def record(self, received: Received) -> int:
        """Append a request; its index."""
        with self._lock:
            self.received.append(received)
            return len(self.received) - 1

    def opened(self, connection: socket.socket) -> None:
        with self._lock:
            self._open.add(connection)
            self.connections += 1

    def closed(self, connection: socket.socket) -> None:
        with self._lock:
            self._open.discard(connection)

    def __enter__(self) -> RewardServer:
        self._thread = threading.Thread(target=self.serve_forever, args=(POLL_S,), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def kill(self) -> None:
        """Stop as a crashed server: no new connection is accepted and every open one is cut."""
        if self._thread is not None:
            self.shutdown()
            self._thread.join()
            self._thread = None
        self.server_close()
        with self._lock:
            for connection in self._open:
                with contextlib.suppress(OSError):  # the handler may have closed it already
                    connection.shutdown(socket.SHUT_RDWR)
            self._open.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reward", default="synthetic_successor", help="registered reward that scores")
    parser.add_argument("--die-after", type=int, default=None, help="exit abruptly on the request after this many")
    args = parser.parse_args()
    scored = scored_by(args.reward)

    def answer(body: dict[str, Any], index: int) -> tuple[int, bytes]:
        if args.die_after is not None and index >= args.die_after:
            os._exit(1)
        return scored(body, index)

    server = RewardServer(answer)
    print(f"port {server.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
