"""Run as ``python -m tests.closed_pipe_probe COMMAND``: `megatron-rl COMMAND` whose handler sends an engine two
requests over one kept-alive connection that the engine closes (a FIN, as SGLang's keep-alive timeout does) just
before the second one is written: the moment of the race, forced by taking away the client's check for a connection
closed while idle. The second request's body (megabytes: http.client writes it after the headers, in many writes)
meets the RST the closed socket answered the headers with: EPIPE. Prints ``answered twice`` and exits 0 when the command
survives; a process killed by SIGPIPE exits 141 from the shell's point of view (-13 to subprocess).
"""

from __future__ import annotations

import socket
import sys
import threading
import time

import megatron_rl.engines.http_engine as http_engine
from megatron_rl import cli
from megatron_rl.engines.http_engine import HttpEngine

ANSWER = b'{"ok": true}'


def _answer_one_request(connection: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        data += connection.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        body += connection.recv(65536)
    status = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(ANSWER)
    connection.sendall(status + ANSWER)


def _engine(listener: socket.socket) -> None:
    """Answer the first request, then close that connection; answer the resend on a new one."""
    for _ in range(2):
        connection, _ = listener.accept()
        _answer_one_request(connection)
        connection.close()


def _two_requests(args: object) -> int:
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_engine, args=(listener,), daemon=True).start()
    engine = HttpEngine("probe", "127.0.0.1", listener.getsockname()[1])
    engine.request("/first", {"n": 1})
    time.sleep(0.2)  # the engine's FIN has arrived
    engine.request("/second", {"ids": list(range(500_000))})  # megabytes: many writes, whenever the RST lands
    print("answered twice")
    return 0


if __name__ == "__main__":
    http_engine._closed_by_peer = lambda sock: False  # the FIN lands after the client's check: the race
    command = sys.argv[1]
    setattr(cli, f"_cmd_{command}", _two_requests)  # build_parser binds the handler by this name
    sys.exit(cli.main([command, "recipe.yaml"]))
