"""TCPStores whose server listens on one address only.

torch's ``TCPStore(host, port, is_master=True)`` listens on every interface (``::``), whatever
``host`` says; ``host`` is only where clients connect. A run keeps its traffic on loopback (one
node) or on the recipe's interface, so the stores it hosts (the trainer's default process
group, the weight-send lock, the weight transport's broadcast group) are built here on a socket
bound to that address and handed to torch (``master_listen_fd``). Clients are torch's own.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

LISTEN_BACKLOG = 2048


def listen_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on ``host:port`` only (``port`` 0: any free port; read it from ``getsockname``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)


def serve_store(
    listener: socket.socket, world_size: int, *, timeout: timedelta, wait_for_workers: bool = True
) -> dist.TCPStore:
    """The TCPStore server of ``world_size`` members (this one included) on ``listener``, which it takes over.

    Blocks, with ``wait_for_workers``, until every member connected or ``timeout`` passed.
    """
    host, port = listener.getsockname()[:2]
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=wait_for_workers,
        master_listen_fd=listener.detach(),
        use_libuv=True,
    )


def rendezvous_store(host: str, port: int, rank: int, world_size: int, *, timeout: timedelta) -> dist.TCPStore:
    """As torch's ``tcp://host:port`` rendezvous store: rank 0 serves (on ``host`` only), the others connect."""
    if rank == 0:
        return serve_store(listen_socket(host, port), world_size, timeout=timeout)
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
