"""One lock across all sending trainer ranks, so broadcasts into shared engines never interleave.

Why: with several sending ranks (one per EP rank or PP stage) and several
engines, each rank owns a broadcast group with every engine. An SGLang engine
serves one weight request at a time and blocks inside it (joining a group,
receiving a broadcast) until the sending rank's whole group takes part. If
rank A's request reaches engine 1 first and rank B's reaches engine 2 first,
engine 1 waits for engine 2 in A's group and engine 2 for engine 1 in B's:
a deadlock. slime serialises these broadcasts behind one lock; so do we.

The lock is a key in a TCPStore hosted by trainer rank 0 (``compare_set`` from
free to the holder's token), listening on rank 0's address only and reachable
from every node there.
A holder must never wait for another trainer rank while holding it (the
transport takes it per bucket, around the requests and the broadcasts only,
never around the export's collectives), so the lock itself cannot deadlock.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from megatron_rl.parallel.stores import listen_socket, serve_store

_KEY = "megatron_rl/weight_send_lock"
_FREE = ""
POLL_S = 0.005


class SendLock:
    """A mutual-exclusion lock shared by the trainer ranks through a TCPStore.

    Build it with :func:`create_send_lock` (collective over the default group). ``holding()``
    blocks until this rank holds the lock, or raises TimeoutError naming the holder after
    ``timeout_s``.
    """

    def __init__(self, store: dist.Store, token: str, *, timeout_s: float) -> None:
        self.store = store
        self.token = token
        self.timeout_s = timeout_s

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Hold the lock for the ``with`` block."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            owner = self.store.compare_set(_KEY, _FREE, self.token).decode()
            if owner == self.token:
                break
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"weight-send lock still held by {owner!r} after {self.timeout_s:.0f} s "
                    f"({self.token} waiting); that rank is stuck in a weight update"
                )
            time.sleep(POLL_S)
        try:
            yield
        finally:
            self.store.set(_KEY, _FREE)


def create_send_lock(address: str, *, timeout_s: float = 1800.0) -> SendLock:
    """The lock of every rank of the default process group (collective over it; one process: a local lock).

    ``address``: rank 0's node address as the other ranks reach it (only rank 0's value is used).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    timeout = timedelta(seconds=timeout_s)
    listener = listen_socket(address) if rank == 0 else None
    endpoint = [address, listener.getsockname()[1]] if listener is not None else [None, None]
    if world > 1:
        dist.broadcast_object_list(endpoint, src=0)
    host, port = endpoint
    if listener is not None:
        store = serve_store(listener, world, timeout=timeout)
    else:
        assert host is not None and port is not None, "rank 0 broadcast its endpoint"
        store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout, wait_for_workers=True)
    return SendLock(store, f"rank{rank}", timeout_s=timeout_s)
