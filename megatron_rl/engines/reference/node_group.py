"""A reference engine of several node processes, started as SGLang 0.5.23 starts one that spans nodes.

Launch contract (SGLang's ``--nnodes N --node-rank k --dist-init-addr host:port``): every node
process joins one torch.distributed group (gloo) whose store node rank 0 serves at
``dist_init_addr`` (on that address only); node rank 0 then serves the HTTP API, the others
serve none (SGLang's node ranks >= 1 run schedulers only). Node 0 opens its HTTP socket once
every node has joined, so its ``/health`` answering means the whole engine is up.

Work, as SGLang's tokenizer manager spreads it over its schedulers (every TP rank gets every
control request; here each node is one rank, ``tp_rank`` = node rank, holding a full replica):

- ``/generate`` with a ``sampling_seed``: node 0 hands such requests to the nodes in turn; the
  node generates with its own replica and answers tokens, log-probs and routed experts. A
  response depends only on its seed, prompt and weights (the forward is batch-invariant), so
  the engine answers what a one-node engine answers. Unseeded requests stay on node 0 (they
  draw from its engine-wide generator, as on one node).
- weight updates, memory release/resume, pause/continue, abort and flush run on every node, node
  0 alongside the others; the first failure is the answer. A weight group is joined by each node
  at ``rank_offset + node rank`` (world size = 1 + every engine rank), and each loads what the
  trainer broadcasts.
- ``/get_weights_by_name`` reads every node and fails (500) when they hold different values.
- ``/weights_checker`` acts on every node (each snapshots, resets, compares its own replica); the first
  failure is the answer; a checksum answers every node's entry in ``ranks``, in node order, as SGLang
  gathers its TP ranks'.

Node loss: node 0's link to a node breaks at once when that process dies (gloo: connection closed);
node 0 then exits (:data:`NODE_LOST_EXIT_CODE`), so ``/health`` fails and its host restarts the
engine whole. A node that loses node 0 exits the same way. Messages are JSON, framed as a length
and a byte tensor over the default group.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.engines.protocol import GenerateRequest
from megatron_rl.engines.reference.backend import ReferenceBackend
from megatron_rl.engines.reference.server import TextReply
from megatron_rl.engines.reference.weight_checker import merge_rank_checksums

logger = logging.getLogger(__name__)

Answer = tuple[int, Any]
Router = Callable[[ReferenceBackend, str, str, dict[str, Any]], Answer]

NODE_LOST_EXIT_CODE = 75
"""Exit status of a node process whose engine lost another node (the engine is restarted whole)."""
JOIN_TIMEOUT_S = 300.0
LINK_TIMEOUT = timedelta(days=30)
"""How long a node waits on its link for a message: an idle engine is not a failure; a dead peer breaks the
link at once."""
LOCAL_PATHS = frozenset({"/health", "/health_generate", "/model_info", "/metrics"})
"""Answered by node 0 alone (what SGLang's HTTP process answers itself)."""
EVERY_NODE_READS = frozenset({"/get_weights_by_name"})
RANK_GATHERS = frozenset({"/weights_checker"})
"""Answers that gather each node's ``ranks`` entries (a checksum), as SGLang's TP ranks all-gather theirs."""


def parse_dist_init_addr(address: str) -> tuple[str, int]:
    """``host:port`` as (host, port); ValueError naming the value otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr must be host:port (port 1..65535), got {address!r}")
    return host, int(port)


def join_nodes(dist_init_addr: str, nnodes: int, node_rank: int, *, timeout_s: float = JOIN_TIMEOUT_S) -> None:
    """Join the engine's node group (this process's default gloo group); blocks until all ``nnodes`` joined."""
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} must be in [0, --nnodes={nnodes})")
    host, port = parse_dist_init_addr(dist_init_addr)
    timeout = timedelta(seconds=timeout_s)
    if node_rank == 0:  # the store listens on dist_init_addr's host only, never on every interface
        listener = socket.create_server((host, port))
        store = dist.TCPStore(
            host, port, nnodes, is_master=True, timeout=timeout, master_listen_fd=listener.detach(), use_libuv=True
        )
    else:
        store = dist.TCPStore(host, port, nnodes, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=node_rank, world_size=nnodes, timeout=LINK_TIMEOUT)
    logger.info("node %d of %d joined the engine's nodes at %s", node_rank, nnodes, dist_init_addr)


class _Link:
    """JSON messages to and from one other node over the default group: sends under a lock, one reader."""

    def __init__(self, node: int) -> None:
        self.node = node
        self._send_lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        data = torch.frombuffer(bytearray(json.dumps(message).encode()), dtype=torch.uint8)
        with self._send_lock:
            dist.send(torch.tensor([data.numel()], dtype=torch.int64), self.node)
            dist.send(data, self.node)

    def recv(self) -> dict[str, Any]:
        length = torch.zeros(1, dtype=torch.int64)
        dist.recv(length, self.node)
        data = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.recv(data, self.node)
        message: dict[str, Any] = json.loads(data.numpy().tobytes())
        return message


def _lost(node: int, error: BaseException) -> None:
    logger.error("engine node %d is gone (%s); this node exits so that the engine is restarted whole", node, error)
    logging.shutdown()
    os._exit(NODE_LOST_EXIT_CODE)


def _to_wire(payload: Any) -> dict[str, Any]:
    if isinstance(payload, TextReply):
        return {"text": payload.text, "status": payload.status, "content_type": payload.content_type}
    return {"json": payload}


def _from_wire(wire: dict[str, Any]) -> Any:
    return wire["json"] if "json" in wire else TextReply(wire["text"], wire["status"], wire["content_type"])


class _Ticket:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.answer: Answer = (500, None)


class NodeGroup:
    """Node 0's side: answers each HTTP request on the node(s) it belongs to (module docstring).

    ``router`` answers a request on a backend (the server's ``answer``); ``nnodes`` >= 2, joined already.
    """

    def __init__(self, backend: ReferenceBackend, nnodes: int, router: Router) -> None:
        self.backend, self.nnodes, self._router = backend, nnodes, router
        self._links = {node: _Link(node) for node in range(1, nnodes)}
        self._tickets: dict[int, _Ticket] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._turn = itertools.cycle(range(nnodes))
        for link in self._links.values():
            threading.Thread(target=self._receive, args=(link,), name=f"node-{link.node}-answers", daemon=True).start()

    def answer(self, path: str, query: str, body: dict[str, Any]) -> Answer:
        """The engine's answer to one request (same shapes as a one-node engine's)."""
        if path in LOCAL_PATHS:
            return self._router(self.backend, path, query, body)
        if path == "/generate":
            return self._generate(query, body)
        tickets = [self._submit(node, path, query, body) for node in self._links]
        local = self._router(self.backend, path, query, body)
        answers = [local, *(self._wait(ticket) for ticket in tickets)]
        failed = next((a for a in answers if a[0] != 200), None)
        if failed is not None:
            return failed
        if path in EVERY_NODE_READS and any(a[1] != local[1] for a in answers):
            differing = [node for node, a in enumerate(answers) if a[1] != local[1]]
            logger.error("%s %s: nodes %s hold other values than node 0", path, body, differing)
            return 500, TextReply("Internal Server Error", 500)
        if path in RANK_GATHERS and "ranks" in local[1]:
            return 200, merge_rank_checksums([a[1] for a in answers])
        return local

    def _generate(self, query: str, body: dict[str, Any]) -> Answer:
        try:
            seeded = GenerateRequest.from_json(body).sampling_params.sampling_seed is not None
        except (ValueError, TypeError, KeyError):
            seeded = False  # node 0 answers the malformed request with its 400
        with self._lock:
            node = next(self._turn) if seeded else 0
        if node == 0:
            return self._router(self.backend, "/generate", query, body)
        return self._wait(self._submit(node, "/generate", query, body))

    def _submit(self, node: int, path: str, query: str, body: dict[str, Any]) -> _Ticket:
        ticket, message_id = _Ticket(), next(self._ids)
        with self._lock:
            self._tickets[message_id] = ticket
        try:
            self._links[node].send({"id": message_id, "path": path, "query": query, "body": body})
        except Exception as error:  # noqa: BLE001 - a link that cannot send means the node is lost
            _lost(node, error)
        return ticket

    @staticmethod
    def _wait(ticket: _Ticket) -> Answer:
        ticket.done.wait()  # a node that dies ends this process (_receive), so this never waits for a dead node
        return ticket.answer

    def _receive(self, link: _Link) -> None:
        while True:
            try:
                message = link.recv()
            except Exception as error:  # noqa: BLE001 - any failure of the link means the node is lost
                _lost(link.node, error)
            with self._lock:
                ticket = self._tickets.pop(message["id"])
            ticket.answer = (message["status"], _from_wire(message["payload"]))
            ticket.done.set()


def serve_node(backend: ReferenceBackend, router: Router) -> None:
    """A node rank >= 1: answer node 0's requests with ``backend`` (each in a thread of its own), until node 0
    is lost (then exit)."""
    link = _Link(0)

    def run(message: dict[str, Any]) -> None:
        status, payload = router(backend, message["path"], message["query"], message["body"])
        try:
            link.send({"id": message["id"], "status": status, "payload": _to_wire(payload)})
        except Exception as error:  # noqa: BLE001 - a failed answer means node 0 is gone
            _lost(0, error)

    while True:
        try:
            message = link.recv()
        except Exception as error:  # noqa: BLE001 - any failure of the link means node 0 is lost
            _lost(0, error)
        threading.Thread(target=run, args=(message,), name=f"node-request-{message['id']}", daemon=True).start()
