"""The broadcast group between one trainer rank (rank 0) and engine ranks, built as SGLang 0.5.23 builds it.

SGLang's engine side of ``/init_weights_update_group`` is
``init_custom_process_group`` (``sglang/srt/utils/common.py``): torch's
``tcp://master_address:master_port`` rendezvous (rank 0 hosts the TCPStore),
the store wrapped in ``PrefixStore(group_name)``, then torch's
``_new_process_group_helper`` with ``group_name``, which adds its own
prefixes (``f"{group_name}/"``, then ``f"{device}/"``) before the backend
publishes its rendezvous keys (the NCCL unique id, gloo's addresses). Both
sides must therefore take exactly this path: a group built on a store with
another prefix chain looks for the keys under other names and waits until
the store times out. :func:`create_weight_group` is that path, used by the
trainer (rank 0) and by the reference engine (ranks >= 1), and pinned against
SGLang's own function by ``tests/unit/test_sglang_protocol.py``.

The group lives outside ``torch.distributed``'s default group (the trainer's
Megatron groups and the engine's own are untouched) and is registered with
the identity rank map, as SGLang registers it, so
``torch.distributed.broadcast(tensor, src=0, group=...)`` addresses it.

One difference, invisible to the members: rank 0's store listens on ``master_address``
only (:mod:`megatron_rl.parallel.stores`), where torch's ``tcp://`` rendezvous would listen
on every interface; the other ranks connect through torch's rendezvous as SGLang's do.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from megatron_rl.parallel.stores import listen_socket, serve_store

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class WeightGroup:
    """A process group of ``world_size`` ranks named ``name``; this process is ``rank``."""

    group: dist.ProcessGroup
    name: str
    rank: int
    world_size: int


def create_weight_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    *,
    timeout_s: float = 300.0,
    listener: socket.socket | None = None,
) -> WeightGroup:
    """Join (rank 0: host) the group; blocks until all ``world_size`` ranks joined or ``timeout_s`` passed.

    Same rendezvous, store prefixes and process-group construction as SGLang's
    ``init_custom_process_group(backend, init_method="tcp://addr:port", world_size, rank, group_name)``.
    Rank 0 serves the store on ``listener`` (a socket listening on ``master_address:master_port``,
    taken over) or, without one, on a socket it binds there.
    Raises ValueError for a rank outside [0, world_size), a backend other than
    ``gloo``/``nccl`` or a group name this process already uses; torch's
    DistStoreError on timeout.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the weight group's world size {world_size}")
    if backend not in BACKENDS:
        raise ValueError(f"weight group backend must be one of {BACKENDS}, got {backend!r}")
    if not group_name:
        raise ValueError("a weight group needs a non-empty group_name (SGLang asserts it)")
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        store = serve_store(listener or listen_socket(master_address, master_port), world_size, timeout=timeout)
    else:
        store, rank, world_size = next(
            c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
        )
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        dist.PrefixStore(group_name, store),
        group_name=c10d.GroupName(group_name),
        backend_options=None,
        timeout=timeout,
        device_id=None,
    )
    assert isinstance(group, dist.ProcessGroup), "every rank is a member (global_ranks_in_group=[])"
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return WeightGroup(group, group_name, rank, world_size)


def broadcast_from_trainer(weight_group: WeightGroup, tensor: torch.Tensor) -> None:
    """Broadcast ``tensor`` (in place on receivers) from rank 0 of the group; blocks until done. An FP8 tensor
    crosses a gloo group as its bytes (gloo has no float8 type; NCCL takes it as it is)."""
    if tensor.element_size() == 1 and tensor.is_floating_point() and dist.get_backend(weight_group.group) == "gloo":
        tensor = tensor.view(torch.uint8)
    dist.broadcast(tensor, src=0, group=weight_group.group)


def destroy_weight_group(weight_group: WeightGroup) -> None:
    """Tear the group down as SGLang's ``/destroy_weights_update_group`` does (``destroy_process_group``)."""
    dist.destroy_process_group(weight_group.group)
