"""A group of Ray actors, one per torch.distributed rank, each hosting a worker object.

The group sets the standard launcher environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``) in every actor before the worker class is constructed, so
workers start torch.distributed exactly as under torchrun. ``MASTER_ADDR`` is rank 0's
address in the run's network (127.0.0.1 on one node, the recipe's interface otherwise), where
its rendezvous store listens, and the ranks get that network's gloo/NCCL interface. Methods
are called on all ranks concurrently (collectives need every rank) and their results come back
in rank order.

Fail-fast: a call returns or raises as soon as any rank fails. A rank whose process died (killed,
out of memory, node lost) ends the call with :class:`RankCallError` naming the rank, its node and
the cause; a rank's exception re-raises as ``ray.get`` raises it (its own type), with a note naming
the rank and node. Neither waits for the other ranks, which may be blocked in a collective with the
failed one (bounded by the process group timeout; the driver's shutdown kills them).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Concatenate, cast

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megatron_rl.engines.server_process import kill_when_parent_dies
from megatron_rl.orchestration.actor_handle import ActorHandle
from megatron_rl.orchestration.errors import RankCallError
from megatron_rl.orchestration.network import RunNetwork
from megatron_rl.orchestration.placement_group import RankSlot

KILL_GRACE_S = 2.0
"""Seconds :meth:`RankWorkerGroup.shutdown` gives ranks to exit through Ray's kill before SIGKILL."""


class _RankHost:
    """Holds one rank's worker; ``start`` sets the launcher environment, then builds the worker."""

    def __init__(self) -> None:
        self._worker: Any = None

    def free_endpoint(self, network: RunNetwork) -> tuple[str, int]:
        address = network.address(ray.util.get_node_ip_address())
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
            port = sock.getsockname()[1]
        return address, port

    def start(self, env: dict[str, str], worker: WorkerSpec[Any]) -> int:
        if sys.platform == "linux":
            # Processes a rank forks (Megatron's checkpoint writers) inherit its sockets: alive after the
            # rank died, they would keep Ray and the process group from seeing the death.
            os.register_at_fork(after_in_child=kill_when_parent_dies)
        os.environ.update(env)
        self._worker = worker.build()
        return os.getpid()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._worker, method)(*args, **kwargs)


class WorkerSpec[W]:
    """How each rank builds its worker, written as the constructor call: ``WorkerSpec(TrainerWorker, cfg, paths)``;
    the type checker holds the arguments to ``cls``'s constructor. Sent to every rank (picklable when they are)."""

    def __init__[**P](self, cls: Callable[P, W], *args: P.args, **kwargs: P.kwargs) -> None:
        self.cls, self.args, self.kwargs = cls, args, kwargs

    @property
    def name(self) -> str:
        """The worker class's name."""
        return str(getattr(self.cls, "__name__", self.cls))

    def build(self) -> W:
        """The worker (on the rank, after its launcher environment is set)."""
        return self.cls(*self.args, **self.kwargs)


class RankArgs[**P]:
    """One rank's arguments in :meth:`RankWorkerGroup.call_per_rank`, written as the call's: ``RankArgs(x, key=y)``;
    the type checker holds them to the method called."""

    def __init__(self, *args: P.args, **kwargs: P.kwargs) -> None:
        self.args, self.kwargs = args, kwargs


def by_reference[T](ref: ray.ObjectRef[T]) -> T:
    """``ref`` as an argument of a rank call, typed as its value: Ray hands the rank's method the value of an
    ``ObjectRef`` argument, fetched by the rank's own process from the object store."""
    return cast(T, ref)


_RemoteRankHost = ray.remote(_RankHost)  # not a class decorator: type checkers ignore what those return


class RankWorkerGroup[W]:
    """``len(slots)`` ranks of ``worker``, rank ``i`` on ``slots[i]`` of ``placement``.

    Calls name the worker's method itself (``group.call(Worker.method, *args)``), so an editor and the type
    checker follow them to the method and check its arguments and result.

    ``network``: where the ranks' rendezvous store listens and which interface gloo/NCCL use
    (default: this node's loopback, for ranks on one node).
    """

    def __init__(
        self,
        worker: WorkerSpec[W],
        placement: PlacementGroup,
        slots: Sequence[RankSlot],
        *,
        num_gpus: float,
        num_cpus: float,
        env: dict[str, str] | None = None,
        network: RunNetwork | None = None,
    ) -> None:
        network = network or RunNetwork()
        self._worker = worker
        self._node_ips = [slot.node_ip for slot in slots]
        self._hosts = [
            ActorHandle.start(
                _RemoteRankHost,
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement, slot.bundle_index),
            )
            for slot in slots
        ]
        master_addr, master_port = ray.get(self._hosts[0].call(_RankHost.free_endpoint, network))
        local_ranks = _local_ranks(slots)
        starts = [
            host.call(
                _RankHost.start,
                network.environment()
                | (env or {})
                | {
                    "RANK": str(rank),
                    "WORLD_SIZE": str(len(slots)),
                    "LOCAL_RANK": str(local_ranks[rank]),
                    "MASTER_ADDR": master_addr,
                    "MASTER_PORT": str(master_port),
                },
                worker,
            )
            for rank, host in enumerate(self._hosts)
        ]
        self._pids: list[int] = self._gather(starts, "start")

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self._hosts)

    @property
    def pids(self) -> list[int]:
        """Each rank's worker process id, in rank order."""
        return list(self._pids)

    @property
    def node_ips(self) -> list[str]:
        """Ray's address of each rank's node, in rank order."""
        return list(self._node_ips)

    def call[**P, R](self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Call ``method`` on every rank's worker concurrently; results in rank order (a rank's error re-raises)."""
        name = self._method_name(method)
        return self._gather([host.call(_RankHost.call, name, *args, **kwargs) for host in self._hosts], name)

    def call_per_rank[**P, R](self, method: Callable[Concatenate[W, P], R], per_rank: Sequence[RankArgs[P]]) -> list[R]:
        """Call ``method`` on rank ``i`` with ``per_rank[i]``, all concurrently; results in rank order.

        An argument that is a Ray ``ObjectRef`` reaches the worker as its value, fetched by the
        rank's own process from the object store: ``ray.put`` a large argument once and pass its
        reference (:func:`by_reference`) to every rank that needs it, so the driver serialises it once.
        """
        name = self._method_name(method)
        if len(per_rank) != len(self._hosts):
            raise ValueError(f"got arguments for {len(per_rank)} ranks, the group has {len(self._hosts)}")
        refs = [
            host.call(_RankHost.call, name, *call.args, **call.kwargs)
            for host, call in zip(self._hosts, per_rank, strict=True)
        ]
        return self._gather(refs, name)

    def _method_name(self, method: Callable[..., Any]) -> str:
        """The name the ranks dispatch on; TypeError when the worker class has no method of that name."""
        name = getattr(method, "__name__", "")
        if not callable(getattr(self._worker.cls, name, None)):
            raise TypeError(f"{self._worker.name}, the ranks' worker class, has no method {name or method!r}")
        return name

    def _gather(self, refs: list[ray.ObjectRef[Any]], method: str) -> list[Any]:
        """The results in rank order; at the first rank that fails (in completion order), its error."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            rank = rank_of[done[0]]
            try:
                ray.get(done[0])
            except ray.exceptions.RayActorError as error:
                raise RankCallError(
                    rank,
                    self._node_ips[rank],
                    method,
                    str(error).splitlines()[0] if str(error) else "its process ended",
                ) from error
            except ray.exceptions.RayTaskError as error:  # the rank's own exception type, as ray.get raises it
                error.add_note(f"raised by trainer rank {rank} on node {self._node_ips[rank]} in {method}")
                raise
        return ray.get(refs)

    def shutdown(self) -> None:
        """Kill every rank's actor; ranks on this node still running after :data:`KILL_GRACE_S` are killed by
        process id.

        A rank blocked in a collective with a dead one does not run Ray's kill until the
        collective times out, and would outlive the job (holding its memory and the driver's
        output pipes) if Ray stopped first; SIGKILL ends it. The grace lets the ranks that do run
        Ray's kill exit through it (killed at once, Ray printed each as a worker that "died or was
        killed ... by an unexpected system error" at the end of every run).
        """
        for host in self._hosts:
            host.kill()
        here = ray.util.get_node_ip_address()
        local = [pid for pid, node_ip in zip(self._pids, self._node_ips, strict=True) if node_ip == here]
        deadline = time.monotonic() + KILL_GRACE_S
        while local and time.monotonic() < deadline:
            time.sleep(0.05)
            local = [pid for pid in local if _running(pid)]
        for pid in local:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self._hosts = []


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):  # gone before the open, or between open and read
        return False
    return state != "Z"


def _local_ranks(slots: Sequence[RankSlot]) -> list[int]:
    seen: dict[str, int] = {}
    local = []
    for slot in slots:
        local.append(seen.get(slot.node_ip, 0))
        seen[slot.node_ip] = local[-1] + 1
    return local
