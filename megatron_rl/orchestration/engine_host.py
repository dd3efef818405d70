"""Rollout engines hosted by Ray actors, one actor per engine, on the node whose GPUs the engine uses.

An :class:`EngineHost` actor sits on the first placement-group bundle of its
engine. :meth:`EngineHost.start` picks the address the engine listens on (the run's
network, :mod:`~megatron_rl.orchestration.network`: 127.0.0.1 on a one-node run, the
recipe's interface on this node otherwise; never every interface) and free ports there,
builds the engine from an :class:`EngineSpec` (SGLang, or our reference server) with the
run's API key, starts it, waits until it is healthy and returns its address; the driver
then talks to it over HTTP (:class:`~megatron_rl.rollout.HttpEngine`, sending the key);
when the engine process dies, those
clients' errors carry its exit code and log tail, which the host reads on the engine's
node (:meth:`EngineHost.process_report`). The server process is
started with ``die_with_parent``: when the actor dies (killed, node lost, driver
gone) the kernel kills the engine, so it never outlives its host.

GPUs: the host actor is started with Ray's ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``,
so it (and the engine it launches) sees the node's devices, not just the
fraction of one GPU Ray gave the actor. The engine's GPU ids are the ones Ray
assigned to its bundles (in the namespace of the node's own ``CUDA_VISIBLE_DEVICES``,
as ``ray.get_gpu_ids()`` reports them); SGLang's ``--base-gpu-id`` indexes the
visible devices, so :func:`first_visible_index` maps the ids to that index
(slime maps the same way) and checks that they are consecutive there, since
SGLang takes ``base_gpu_id .. base_gpu_id + tp*dp - 1``.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megatron_rl.orchestration.network import RunNetwork
from megatron_rl.plan.placement import ActorResources
from megatron_rl.rollout import EngineStartupError, HttpEngine, ReferenceEngine, SGLangEngine, SGLangPlacement
from megatron_rl.rollout.access import check_listen_host

if TYPE_CHECKING:
    from megatron_rl.config.schema import RolloutConfig

NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
SHUTDOWN_TIMEOUT_S = 30.0
HOST_REPORT_TIMEOUT_S = 10.0
"""Seconds a host actor has to report on its engine process, beyond the settle time asked for."""

EngineAddress = tuple[str, str, int]
"""(name, host, port) of a running rollout engine."""


@dataclass(frozen=True)
class EngineSpec:
    """What one host launches: the engine's kind, model, GPUs and start-up limits.

    ``gpu_ids``: the GPU ids Ray assigned to the engine's bundles, in order (empty on CPU).
    ``routed_experts_shape``: (num_layers, top_k) when routing replay is on, else None.
    ``network``: where the engine listens; ``api_key``: the run's key the engine requires (kept out
    of the spec's repr, of its command line and of its log).
    """

    name: str
    kind: Literal["sglang", "reference"]
    model_path: str
    log_dir: str
    rollout: RolloutConfig
    seed: int
    gpu_ids: tuple[str, ...] = ()
    routing_replay: bool = False
    routed_experts_shape: tuple[int, int] | None = None
    network: RunNetwork = field(default_factory=RunNetwork)
    api_key: str | None = field(default=None, repr=False)


def first_visible_index(gpu_ids: Sequence[str], visible_devices: str | None) -> int:
    """Index of ``gpu_ids[0]`` among the visible devices, the ids consecutive there (SGLang's ``base_gpu_id``).

    ``visible_devices``: the process's ``CUDA_VISIBLE_DEVICES`` (None or empty: every device, ids are indices).
    Raises ValueError for no ids, an id that is not visible, or ids that are not consecutive.
    """
    if not gpu_ids:
        raise ValueError("an engine on GPUs needs at least one GPU id")
    visible = [d.strip() for d in visible_devices.split(",") if d.strip()] if visible_devices else None
    ids = [str(gpu).strip() for gpu in gpu_ids]
    if visible is None:
        if not all(gpu.isdigit() for gpu in ids):
            raise ValueError(f"GPU ids {ids} are not device indices and CUDA_VISIBLE_DEVICES is unset")
        indices = [int(gpu) for gpu in ids]
    else:
        missing = [gpu for gpu in ids if gpu not in visible]
        if missing:
            raise ValueError(f"GPU ids {missing} are not in CUDA_VISIBLE_DEVICES={visible_devices!r}")
        indices = [visible.index(gpu) for gpu in ids]
    if indices != list(range(indices[0], indices[0] + len(indices))):
        raise ValueError(
            f"the engine's GPUs {ids} sit at visible indices {indices}; SGLang needs consecutive devices "
            "(base_gpu_id .. base_gpu_id + tp*dp - 1)"
        )
    return indices[0]


def sglang_placement(
    gpu_ids: Sequence[str], visible_devices: str | None, *, host: str, port: int, nccl_port: int
) -> SGLangPlacement:
    """The :class:`SGLangPlacement` of an engine on ``gpu_ids`` of one node (none: on the CPU), serving on
    ``host:port``."""
    if not gpu_ids:
        return SGLangPlacement(base_gpu_id=0, port=port, nccl_port=nccl_port, host=host, device="cpu")
    return SGLangPlacement(
        base_gpu_id=first_visible_index(gpu_ids, visible_devices), port=port, nccl_port=nccl_port, host=host
    )


def build_engine(spec: EngineSpec, *, host: str, port: int, nccl_port: int, visible_devices: str | None) -> HttpEngine:
    """The engine ``spec`` names, bound to ``host:port``, not started; its server dies with the caller's thread.

    Its server gets the run network's gloo/NCCL interface and the spec's API key.
    Raises ValueError for a wildcard ``host`` (every interface).
    """
    check_listen_host(host)
    env = spec.network.environment()
    if spec.kind == "sglang":
        placement = sglang_placement(spec.gpu_ids, visible_devices, host=host, port=port, nccl_port=nccl_port)
        return SGLangEngine(
            spec.name,
            spec.rollout,
            placement,
            spec.model_path,
            log_dir=spec.log_dir,
            routing_replay=spec.routing_replay,
            routed_experts_shape=spec.routed_experts_shape,
            seed=spec.seed,
            die_with_parent=True,
            api_key=spec.api_key,
            env=env,
        )
    device = f"cuda:{first_visible_index(spec.gpu_ids, visible_devices)}" if spec.gpu_ids else "cpu"
    return ReferenceEngine(
        spec.name,
        spec.model_path,
        port,
        log_dir=spec.log_dir,
        host=host,
        device=device,
        seed=spec.seed,
        max_concurrent_requests=spec.rollout.max_concurrent_requests,
        request_timeout_s=spec.rollout.request_timeout_s,
        routed_experts_shape=spec.routed_experts_shape,
        die_with_parent=True,
        api_key=spec.api_key,
        env=env,
    )


PORT_ATTEMPTS = 3
"""Launches of one engine on fresh ports when the last one found its address in use."""


def free_ports(count: int, host: str) -> list[int]:
    """``count`` distinct TCP ports free on ``host`` (an address of this node) at the time of the call."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((check_listen_host(host), 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class EngineHost:
    """Runs one engine on this node (a Ray actor: see :class:`EngineHosts`)."""

    def __init__(self) -> None:
        self._engine: HttpEngine | None = None

    def start(self, spec: EngineSpec) -> EngineAddress:
        """Launch ``spec``'s engine on this node and wait until it is healthy; its (name, host, port).

        Ports are picked free just before the launch, so another process may bind one first (seen in CI:
        two runs on one machine): an engine that exits because its address is in use starts again on
        fresh ports, up to :data:`PORT_ATTEMPTS` times. Raises EngineStartupError (exit code and log tail)
        when it exits otherwise, or is not healthy within ``rollout.startup_timeout_s``; the process is
        stopped then.
        """
        attempt = 1
        while True:
            try:
                return self._start_once(spec)
            except EngineStartupError as error:
                if attempt >= PORT_ATTEMPTS or "address already in use" not in str(error).lower():
                    raise
            attempt += 1

    def _start_once(self, spec: EngineSpec) -> EngineAddress:
        host = spec.network.address(ray.util.get_node_ip_address())
        port, nccl_port = free_ports(2, host)
        engine = build_engine(
            spec, host=host, port=port, nccl_port=nccl_port, visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES")
        )
        self._engine = engine
        engine.start()
        try:
            engine.wait_healthy(spec.rollout.startup_timeout_s)
        except BaseException:
            engine.shutdown()
            raise
        return spec.name, host, port

    def restart(self, spec: EngineSpec) -> EngineAddress:
        """Stop the engine (if its process still runs) and :meth:`start` a new one from ``spec``: fresh ports,
        the weights of ``spec.model_path``; its (name, host, port) once healthy."""
        self.shutdown()
        self._engine = None
        return self.start(spec)

    def process_report(self, settle_s: float = 0.0) -> str:
        """The engine's exit code and log tail once its process has ended (read on this node), else ''."""
        return "" if self._engine is None else self._engine.process_report(settle_s)

    def pid(self) -> int | None:
        """Process id of the engine server (None before start)."""
        return None if self._engine is None or self._engine.process is None else self._engine.process.pid

    def shutdown(self) -> None:
        """Stop the engine process (SIGTERM, then SIGKILL); safe to call twice."""
        if self._engine is not None:
            self._engine.shutdown()


RemoteEngineHost = ray.remote(EngineHost)
EngineHostHandle = Any
"""A :class:`RemoteEngineHost` actor handle: its methods resolve at run time (``ray.actor.ActorHandle`` types
every method ``Never``, so that to a type checker nothing after a call would run)."""


def host_process_report(host: EngineHostHandle, name: str, settle_s: float) -> str:
    """``host``'s :meth:`EngineHost.process_report` for engine ``name``, or why the host cannot give it."""
    timeout_s = settle_s + HOST_REPORT_TIMEOUT_S
    try:
        return ray.get(host.process_report.remote(settle_s), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        return f"; the host actor of engine {name} gave no process report within {timeout_s:.0f} s"
    except ray.exceptions.RayActorError as error:
        return f"; the host actor of engine {name} is gone, and its log with it unless its node is up: {error}"


class EngineHosts:
    """One :class:`EngineHost` actor per spec, each on the first of its bundles; the engines start on construction.

    Construction returns as soon as every host is asked to start its engine, so the caller can build
    the trainer ranks meanwhile; :meth:`wait_healthy` returns once every engine answers. ``addresses``
    and ``clients`` exist from then on: HTTP clients of the engines in spec order, sending the specs'
    API key; when an engine's process has died, their errors carry its exit code and log tail, read by
    its host on the engine's node.
    Start-up failures raise EngineStartupError naming the engine (after stopping every host);
    :meth:`close` stops them all, started or not.
    """

    def __init__(
        self,
        specs: Sequence[EngineSpec],
        placement: PlacementGroup,
        bundle_indices: Sequence[int],
        resources: ActorResources,
    ) -> None:
        if len(specs) != len(bundle_indices):
            raise ValueError(f"{len(specs)} engine specs for {len(bundle_indices)} bundles")
        self._specs = list(specs)
        self._placement, self._bundle_indices, self._resources = placement, list(bundle_indices), resources
        self._hosts = [self._new_host(index) for index in range(len(self._specs))]
        self._starting = [h.start.remote(s) for h, s in zip(self._hosts, specs, strict=True)]
        self._addresses: list[EngineAddress] | None = None
        self._clients: list[HttpEngine] | None = None

    def wait_healthy(self) -> None:
        """Return once every engine is healthy (at once after the first call); on a failure, stop every host
        and raise EngineStartupError naming the engine."""
        if self._clients is not None:
            return
        try:
            addresses = self._gather(self._starting)
        except BaseException:
            self.close()
            raise
        self._addresses = addresses
        self._clients = [
            HttpEngine(
                name,
                host,
                port,
                remote_process_report=functools.partial(host_process_report, actor, name),
                max_concurrent_requests=spec.rollout.max_concurrent_requests,
                request_timeout_s=spec.rollout.request_timeout_s,
                routed_experts_shape=spec.routed_experts_shape,
                api_key=spec.api_key,
            )
            for (name, host, port), spec, actor in zip(addresses, self._specs, self._hosts, strict=True)
        ]

    @property
    def addresses(self) -> list[EngineAddress]:
        """Each engine's (name, host, port), in spec order; RuntimeError before :meth:`wait_healthy`."""
        if self._addresses is None:
            raise RuntimeError("engine addresses are known once EngineHosts.wait_healthy has returned")
        return self._addresses

    @property
    def clients(self) -> list[HttpEngine]:
        """An HTTP client per engine, in spec order; RuntimeError before :meth:`wait_healthy`."""
        if self._clients is None:
            raise RuntimeError("engine clients exist once EngineHosts.wait_healthy has returned")
        return self._clients

    def _new_host(self, index: int) -> EngineHostHandle:
        """A host actor for engine ``index`` on the first of its bundles."""
        return RemoteEngineHost.options(
            num_gpus=self._resources.num_gpus,
            num_cpus=self._resources.num_cpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._placement, self._bundle_indices[index]),
            runtime_env={"env_vars": {NOSET_CUDA_VISIBLE_DEVICES: "1"}},
        ).remote()

    def restart(self, index: int) -> EngineAddress:
        """Start engine ``index`` again on its bundle, as at start-up; its client now talks to the new process.

        The host actor restarts it in place; a host actor that is gone is replaced on the same bundle.
        Returns the new (name, host, port); EngineStartupError when the new process does not become healthy.
        """
        spec, host = self._specs[index], self._hosts[index]
        try:
            address = self._gather([host.restart.remote(spec)], [spec])[0]
        except EngineStartupError as error:
            if not isinstance(error.__cause__, ray.exceptions.RayActorError):
                raise
            ray.kill(host)
            host = self._hosts[index] = self._new_host(index)
            address = self._gather([host.start.remote(spec)], [spec])[0]
        self.addresses[index] = address
        _, ip, port = address
        self.clients[index].rebind(ip, port, functools.partial(host_process_report, host, spec.name))
        return address

    def _gather(self, refs: list[ray.ObjectRef], specs: Sequence[EngineSpec] | None = None) -> list[EngineAddress]:
        addresses = []
        for spec, ref in zip(self._specs if specs is None else specs, refs, strict=True):
            try:
                addresses.append(ray.get(ref))
            except ray.exceptions.RayTaskError as error:
                cause = error.cause if isinstance(error.cause, Exception) else error
                raise EngineStartupError(f"engine {spec.name} failed to start: {cause}") from error
            except ray.exceptions.RayActorError as error:
                raise EngineStartupError(f"the host actor of engine {spec.name} died: {error}") from error
        return addresses

    def pids(self) -> list[int | None]:
        """Process ids of the engine servers, in spec order."""
        return ray.get([host.pid.remote() for host in self._hosts])

    def close(self) -> None:
        """Stop every engine, then end its host actor (an engine whose stop fails dies with its actor)."""
        stops = [host.shutdown.remote() for host in self._hosts]
        ray.wait(stops, num_returns=len(stops), timeout=SHUTDOWN_TIMEOUT_S)
        for host in self._hosts:
            ray.kill(host)
        self._hosts = []
