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

Engines spanning nodes (SGLang 0.5.23's launch: one server process per node with ``--nnodes``,
``--node-rank``, ``--dist-init-addr``; node rank 0 serves HTTP, the others run its schedulers):
one host actor per node of the engine, each on the first of its node's bundles, each launching
its node's process (:class:`EngineSpec` ``node_rank``, its node's GPU ids). Node 0's host picks the
``dist_init_addr`` (its address, a free port) at every start. The engine is healthy when node 0's
``/health`` answers and every node's process runs (each node's host then deletes its key file); a crash
of any node's process is reported by the engine's client (it names the node) and
:meth:`EngineHosts.restart` restarts all of them.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megatron_rl.config.schema import LoRAConfig
from megatron_rl.engines import EngineStartupError, HttpEngine, ReferenceEngine, SGLangEngine, SGLangPlacement
from megatron_rl.engines.access import check_listen_host
from megatron_rl.engines.protocol import LoRASettings
from megatron_rl.orchestration.actor_handle import ActorHandle
from megatron_rl.orchestration.network import RunNetwork
from megatron_rl.plan.placement import ActorResources

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
    ``lora``: the recipe's ``lora:`` section: the engine serves LoRA adapters (SGLang's ``--enable-lora`` flags).
    ``nnodes``/``node_rank``: one node's process of an engine spanning ``nnodes`` nodes (``gpu_ids``: that
    node's); ``dist_init_addr`` (node 0's ``host:port``) is filled in by :class:`EngineHosts` at each start.
    ``model_path`` and ``log_dir`` are absolute (ValueError otherwise): a host on another node has a working
    directory of its own.
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
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    lora: LoRAConfig | None = None

    def __post_init__(self) -> None:
        paths = {"model_path": self.model_path, "log_dir": self.log_dir}
        relative = {name: path for name, path in paths.items() if not Path(path).is_absolute()}
        if relative:
            raise ValueError(
                f"engine {self.name}: EngineSpec takes absolute paths (engine_specs resolves them), not {relative}"
            )


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
    gpu_ids: Sequence[str],
    visible_devices: str | None,
    *,
    host: str,
    port: int,
    nccl_port: int,
    nnodes: int = 1,
    node_rank: int = 0,
    dist_init_addr: str | None = None,
) -> SGLangPlacement:
    """The :class:`SGLangPlacement` of an engine (or of one node's process of an engine spanning ``nnodes``)
    on ``gpu_ids`` of this node (none: on the CPU), serving on ``host:port``."""
    return SGLangPlacement(
        base_gpu_id=first_visible_index(gpu_ids, visible_devices) if gpu_ids else 0,
        port=port,
        nccl_port=nccl_port,
        host=host,
        dist_init_addr=dist_init_addr,
        nnodes=nnodes,
        node_rank=node_rank,
        device="cuda" if gpu_ids else "cpu",
    )


def build_engine(spec: EngineSpec, *, host: str, port: int, nccl_port: int, visible_devices: str | None) -> HttpEngine:
    """The engine ``spec`` names, bound to ``host:port``, not started; its server dies with the caller's thread.

    Its server gets the run network's gloo/NCCL interface and the spec's API key.
    Raises ValueError for a wildcard ``host`` (every interface).
    """
    check_listen_host(host)
    env = spec.network.environment()
    name = spec.name if spec.node_rank == 0 else f"{spec.name}-node{spec.node_rank}"  # its own log file
    if spec.kind == "sglang":
        placement = sglang_placement(
            spec.gpu_ids,
            visible_devices,
            host=host,
            port=port,
            nccl_port=nccl_port,
            nnodes=spec.nnodes,
            node_rank=spec.node_rank,
            dist_init_addr=spec.dist_init_addr,
        )
        return SGLangEngine(
            name,
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
            lora=spec.lora,
        )
    device = f"cuda:{first_visible_index(spec.gpu_ids, visible_devices)}" if spec.gpu_ids else "cpu"
    return ReferenceEngine(
        name,
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
        nnodes=spec.nnodes,
        node_rank=spec.node_rank,
        dist_init_addr=spec.dist_init_addr,
        lora=LoRASettings.of(spec.lora) if spec.lora is not None else None,
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

    def dist_init_address(self, spec: EngineSpec) -> str:
        """``host:port`` for the node processes of ``spec``'s engine to meet at: this node's address in the run's
        network and a port free there now (node rank 0's host picks it before each start)."""
        host = spec.network.address(ray.util.get_node_ip_address())
        return f"{host}:{free_ports(1, host)[0]}"

    def start(self, spec: EngineSpec) -> EngineAddress:
        """Launch ``spec``'s engine on this node and wait until it is healthy; its (name, host, port).

        A node rank >= 1 of an engine spanning nodes serves no HTTP: its process is started and the call
        returns at once (node 0's ``/health`` tells when the engine is up; then :meth:`engine_healthy`).

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
        if spec.node_rank > 0:
            return spec.name, host, port
        try:
            engine.wait_healthy(spec.rollout.startup_timeout_s)
        except BaseException:
            engine.shutdown()
            raise
        return spec.name, host, port

    def running(self) -> bool:
        """Whether the engine process started here still runs."""
        return self._engine is not None and self._engine.process is not None and self._engine.process.exit_code is None

    def engine_healthy(self) -> bool:
        """Called on a node rank >= 1 once node 0 of its engine answers ``/health``: this node's process has read
        its start-up secrets (SGLang's key file: it reads its arguments before joining node 0), which are deleted
        now; whether the process still runs."""
        if self._engine is not None:
            self._engine.discard_start_secrets()
        return self.running()

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


def host_process_report(host: ActorHandle[EngineHost], name: str, settle_s: float) -> str:
    """``host``'s :meth:`EngineHost.process_report` for engine ``name``, or why the host cannot give it."""
    timeout_s = settle_s + HOST_REPORT_TIMEOUT_S
    try:
        return ray.get(host.call(EngineHost.process_report, settle_s), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        return f"; the host actor of engine {name} gave no process report within {timeout_s:.0f} s"
    except ray.exceptions.RayActorError as error:
        return f"; the host actor of engine {name} is gone, and its log with it unless its node is up: {error}"


def engine_process_report(hosts: Sequence[ActorHandle[EngineHost]], name: str, settle_s: float) -> str:
    """The process report of engine ``name`` whose node processes ``hosts`` run (node rank order): every ended
    node's, each named by its node rank when the engine spans nodes; '' while all run."""
    if len(hosts) == 1:
        return host_process_report(hosts[0], name, settle_s)
    reports = [host_process_report(host, f"{name} (node {node})", settle_s) for node, host in enumerate(hosts)]
    return "".join(f"; node {node}{report}" for node, report in enumerate(reports) if report)


class EngineHosts:
    """One :class:`EngineHost` actor per engine process, each on the first of its bundles; the engines start on
    construction.

    ``specs``: per engine, its spec, or for an engine spanning nodes one spec per node in node-rank
    order (``nnodes`` of them); ``bundle_indices`` alike: an engine's first bundle, or the first bundle
    of each of its nodes. Construction returns as soon as every host is asked to start its process, so
    the caller can build the trainer ranks meanwhile; :meth:`wait_healthy` returns once every engine
    answers. ``addresses`` and ``clients`` exist from then on: HTTP clients of the engines (node 0) in
    spec order, sending the specs' API key; when an engine process has died, their errors carry its
    exit code and log tail, read by its host on its node.
    Start-up failures raise EngineStartupError naming the engine (after stopping every host);
    :meth:`close` stops them all, started or not.
    """

    def __init__(
        self,
        specs: Sequence[EngineSpec | Sequence[EngineSpec]],
        placement: PlacementGroup,
        bundle_indices: Sequence[int | Sequence[int]],
        resources: ActorResources,
    ) -> None:
        if len(specs) != len(bundle_indices):
            raise ValueError(f"{len(specs)} engine specs for {len(bundle_indices)} bundles")
        self._nodes = [[spec] if isinstance(spec, EngineSpec) else list(spec) for spec in specs]
        self._bundles = [[index] if isinstance(index, int) else list(index) for index in bundle_indices]
        for nodes, bundles in zip(self._nodes, self._bundles, strict=True):
            if len(nodes) != len(bundles) or [s.node_rank for s in nodes] != list(range(nodes[0].nnodes)):
                raise ValueError(
                    f"engine {nodes[0].name}: {len(nodes)} node specs (ranks {[s.node_rank for s in nodes]}) and "
                    f"{len(bundles)} bundles for {nodes[0].nnodes} nodes"
                )
        self._specs = [nodes[0] for nodes in self._nodes]
        self._placement, self._resources = placement, resources
        self._hosts = [[self._new_host(index, node) for node in range(len(n))] for index, n in enumerate(self._nodes)]
        self._starting = [self._launch(index) for index in range(len(self._nodes))]
        self._addresses: list[EngineAddress] | None = None
        self._clients: list[HttpEngine] | None = None

    def _launch(self, index: int) -> list[ray.ObjectRef[EngineAddress]]:
        """Ask every node host of engine ``index`` to start its process (node 0's host picks where they meet)."""
        nodes, hosts = self._nodes[index], self._hosts[index]
        if len(nodes) == 1:
            return [hosts[0].call(EngineHost.start, nodes[0])]
        try:
            meet = ray.get(hosts[0].call(EngineHost.dist_init_address, nodes[0]), timeout=HOST_REPORT_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as error:
            raise EngineStartupError(f"engine {nodes[0].name}: its node 0 host gave no address: {error}") from error
        return [h.call(EngineHost.start, replace(s, dist_init_addr=meet)) for h, s in zip(hosts, nodes, strict=True)]

    def _report(self, index: int) -> functools.partial[str]:
        return functools.partial(engine_process_report, list(self._hosts[index]), self._specs[index].name)

    def wait_healthy(self) -> None:
        """Return once every engine is healthy (at once after the first call); on a failure, stop every host
        and raise EngineStartupError naming the engine."""
        if self._clients is not None:
            return
        try:
            addresses = [self._await(index, refs) for index, refs in enumerate(self._starting)]
        except BaseException:
            self.close()
            raise
        self._addresses = addresses
        self._clients = [
            HttpEngine(
                name,
                host,
                port,
                remote_process_report=self._report(index),
                max_concurrent_requests=spec.rollout.max_concurrent_requests,
                request_timeout_s=spec.rollout.request_timeout_s,
                routed_experts_shape=spec.routed_experts_shape,
                api_key=spec.api_key,
            )
            for index, ((name, host, port), spec) in enumerate(zip(addresses, self._specs, strict=True))
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

    def _new_host(self, index: int, node: int = 0) -> ActorHandle[EngineHost]:
        """A host actor for node ``node`` of engine ``index`` on the first of that node's bundles."""
        return ActorHandle.start(
            RemoteEngineHost,
            num_gpus=self._resources.num_gpus,
            num_cpus=self._resources.num_cpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._placement, self._bundles[index][node]),
            runtime_env={"env_vars": {NOSET_CUDA_VISIBLE_DEVICES: "1"}},
        )

    def restart(self, index: int) -> EngineAddress:
        """Start engine ``index`` again on its bundles, as at start-up, every node's process (a crash of any one
        restarts the whole engine); its client now talks to the new node 0.

        Each host actor stops its process and starts a new one; a host actor that is gone is replaced on the
        same bundle. Returns the new (name, host, port); EngineStartupError when the new engine is not healthy.
        """
        hosts = self._hosts[index]
        stops = [host.call(EngineHost.shutdown) for host in hosts]
        for node, stop in enumerate(stops):
            try:
                ray.get(stop, timeout=SHUTDOWN_TIMEOUT_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                hosts[node].kill()  # its engine dies with it (die_with_parent)
                hosts[node] = self._new_host(index, node)
        address = self._await(index, self._launch(index))
        self.addresses[index] = address
        _, ip, port = address
        self.clients[index].rebind(ip, port, self._report(index))
        return address

    def _await(self, index: int, refs: list[ray.ObjectRef[EngineAddress]]) -> EngineAddress:
        """Engine ``index``'s address once node 0 is healthy and every node's process runs."""
        spec, hosts = self._specs[index], self._hosts[index]
        try:
            address = ray.get(refs[0])
            ray.get(refs[1:])
            running = ray.get([host.call(EngineHost.engine_healthy) for host in hosts[1:]])
        except ray.exceptions.RayTaskError as error:
            cause = error.cause if isinstance(error.cause, Exception) else error
            raise EngineStartupError(f"engine {spec.name} failed to start: {cause}") from error
        except ray.exceptions.RayActorError as error:
            raise EngineStartupError(f"a host actor of engine {spec.name} died: {error}") from error
        if not all(running):
            raise EngineStartupError(
                f"engine {spec.name}: node 0 became healthy but a node process ended{self._report(index)(0.0)}"
            )
        return address

    def pids(self) -> list[int | None]:
        """Process ids of the engine servers (node 0's), in spec order."""
        return ray.get([hosts[0].call(EngineHost.pid) for hosts in self._hosts])

    def running(self) -> list[bool]:
        """Whether each engine's processes all still run, in spec order (a host actor that is gone, or does not
        answer within HOST_REPORT_TIMEOUT_S, counts as not running)."""
        states = []
        for hosts in self._hosts:
            try:
                states.append(
                    all(ray.get([host.call(EngineHost.running) for host in hosts], timeout=HOST_REPORT_TIMEOUT_S))
                )
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                states.append(False)
        return states

    def node_pids(self, index: int) -> list[int | None]:
        """Process ids of engine ``index``'s node processes, in node-rank order."""
        return ray.get([host.call(EngineHost.pid) for host in self._hosts[index]])

    def close(self) -> None:
        """Stop every engine process, then end its host actor (a process whose stop fails dies with its actor)."""
        hosts = [host for engine in self._hosts for host in engine]
        stops = [host.call(EngineHost.shutdown) for host in hosts]
        ray.wait(stops, num_returns=len(stops), timeout=SHUTDOWN_TIMEOUT_S)
        for host in hosts:
            host.kill()
        self._hosts = []
