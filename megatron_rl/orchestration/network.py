"""Where a run's processes listen: 127.0.0.1 when it fits one node, the recipe's interface on several.

A run on one node (``cluster.nodes: 1``) keeps all its traffic on the loopback interface:
Ray is started on 127.0.0.1 (:mod:`resources`), engines serve on 127.0.0.1, the trainer's
process-group stores and the weight transport's broadcast group are hosted there, and gloo
(NCCL on GPU) use the loopback interface. A run on several nodes uses the interface the
recipe names (``cluster.network_interface``, e.g. ``ib0``): on each node, the address of that
interface. Nothing listens on a wildcard address (every interface).

Which address on a node: Ray's address of the node when it belongs to one of the interface's
networks (how a node with several addresses on one interface, or the loopback "nodes"
127.0.0.1 and 127.0.0.2 of the two-raylet test, keep apart), else the interface's first IPv4
address. A node without the interface, or without an IPv4 address on it, is an error naming
the node and the interfaces it has.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import Any

import psutil

from megatron_rl.config.schema import ClusterConfig, RunConfig

LOOPBACK_ADDRESS = "127.0.0.1"
SOCKET_INTERFACE_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""What gloo and NCCL read for the interface they listen and connect on."""


class NetworkError(RuntimeError):
    """The interface a run must use is missing on a node, or has no IPv4 address there."""


def _ipv4_addresses(interface: str, node: str) -> list[tuple[str, str]]:
    interfaces = psutil.net_if_addrs()
    if interface not in interfaces:
        raise NetworkError(
            f"cluster.network_interface: node {node} has no interface {interface!r}; its interfaces are "
            f"{', '.join(sorted(interfaces))} (`ip -brief addr` shows their addresses)"
        )
    found = [(a.address, a.netmask or "255.255.255.255") for a in interfaces[interface] if a.family == socket.AF_INET]
    if not found:
        raise NetworkError(f"cluster.network_interface: interface {interface!r} of node {node} has no IPv4 address")
    return found


def interface_address(interface: str, node_ip: str | None = None) -> str:
    """The address of ``interface`` on this node: ``node_ip`` when it lies on one of its networks, else its first IPv4.

    Raises NetworkError when this node lacks the interface or an IPv4 address on it.
    """
    addresses = _ipv4_addresses(interface, node_ip or socket.gethostname())
    if node_ip is not None:
        try:
            node = ipaddress.ip_address(node_ip)
        except ValueError:
            node = None
        for address, netmask in addresses:
            if node is not None and node in ipaddress.ip_network(f"{address}/{netmask}", strict=False):
                return node_ip
    return addresses[0][0]


def loopback_interface() -> str:
    """The name of the interface holding 127.0.0.1 (``lo`` on Linux)."""
    interfaces: dict[str, list[Any]] = psutil.net_if_addrs()  # psutil ships no types
    for name, addresses in interfaces.items():
        if any(a.family == socket.AF_INET and a.address == LOOPBACK_ADDRESS for a in addresses):
            return name
    return "lo"


@dataclass(frozen=True)
class RunNetwork:
    """The network a run listens on: loopback (``interface`` None) or one named interface per node."""

    interface: str | None = None

    @classmethod
    def of(cls, cluster: ClusterConfig, nodes: int | None = None) -> RunNetwork:
        """Loopback for a one-node run, else ``cluster.network_interface`` (the recipe check requires it).

        ``nodes``: the job's nodes (``RunConfig.job_nodes``: a judge may add its own); default ``cluster.nodes``.
        """
        nodes = cluster.nodes if nodes is None else nodes
        if nodes == 1:
            return cls(None)
        if cluster.network_interface is None:
            raise NetworkError(f"cluster.network_interface: required on {nodes} nodes")
        return cls(cluster.network_interface)

    @classmethod
    def of_run(cls, cfg: RunConfig) -> RunNetwork:
        """The network of the run ``cfg`` on all its nodes (``RunConfig.job_nodes``: a judge may add its own)."""
        return cls.of(cfg.cluster, cfg.job_nodes)

    @property
    def is_loopback(self) -> bool:
        """Whether the run stays on this node's loopback interface."""
        return self.interface is None

    def address(self, node_ip: str | None = None) -> str:
        """The address servers on the node Ray knows as ``node_ip`` listen on and are reached at."""
        if self.interface is None:
            return LOOPBACK_ADDRESS
        return interface_address(self.interface, node_ip)

    def socket_interface(self) -> str:
        """The interface name gloo and NCCL are told to use (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``)."""
        return self.interface or loopback_interface()

    def environment(self) -> dict[str, str]:
        """Environment variables that keep gloo and NCCL sockets on this network, for ranks and engines."""
        interface = self.socket_interface()
        return dict.fromkeys(SOCKET_INTERFACE_ENV, interface)

    def describe(self) -> str:
        """A phrase for messages: ``loopback (127.0.0.1)`` or ``interface ib0``."""
        return f"loopback ({LOOPBACK_ADDRESS})" if self.interface is None else f"interface {self.interface}"
