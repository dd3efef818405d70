"""A stand-alone broadcast group between one trainer rank (rank 0) and engine ranks.

It lives outside ``torch.distributed``'s default group (the trainer's Megatron
groups and the engine's own are untouched): rank 0 hosts a TCPStore at
``master_address:master_port``, the others connect to it, and a
``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (GPU) is built on a store
prefixed with the group name. Both sides of
``/init_weights_update_group`` call :func:`create_weight_group` with the same
address, port, world size and name.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class WeightGroup:
    """A process group and the TCPStore it was built on (rank 0 hosts the store: keep both alive together)."""

    group: dist.ProcessGroup
    store: dist.TCPStore


def create_weight_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    *,
    timeout_s: float = 300.0,
) -> WeightGroup:
    """Join (rank 0: host) the group; blocks until all ``world_size`` ranks joined or ``timeout_s`` passed.

    Raises ValueError for a rank outside [0, world_size) or a backend other
    than ``gloo``/``nccl``; torch's DistStoreError on timeout.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the weight group's world size {world_size}")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    elif backend == "nccl":
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size)
    else:
        raise ValueError(f"weight group backend must be 'gloo' or 'nccl', got {backend!r}")
    return WeightGroup(group, store)


def broadcast_from_trainer(weight_group: WeightGroup, tensor: torch.Tensor) -> None:
    """Broadcast ``tensor`` (in place on receivers) from rank 0 of ``group``; blocks until done."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    weight_group.group.broadcast([tensor], options).wait()
