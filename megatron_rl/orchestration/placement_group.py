"""Ray placement of trainer ranks: one bundle per rank, ordered by (node, GPU) so ranks are contiguous per node."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import ray
from ray.util import placement_group
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megatron_rl.plan.placement import PlacementError

__all__ = ["PlacementError", "RankSlot", "check_capacity", "create_rank_slots", "engine_gpu_ids", "engine_node_slots"]


@dataclass(frozen=True)
class RankSlot:
    """Where one rank runs: a bundle of the placement group and the node it landed on."""

    bundle_index: int
    node_ip: str
    gpu_ids: tuple[str, ...]


@ray.remote(num_cpus=0)
def _probe_bundle() -> tuple[str, tuple[str, ...]]:
    return ray.util.get_node_ip_address(), tuple(str(gpu) for gpu in ray.get_gpu_ids())


def bundle_resources(num_gpus: float, num_cpus: float) -> dict[str, float]:
    """The resources of one rank's bundle (no GPU key on CPU-only runs)."""
    return {"CPU": num_cpus} | ({"GPU": num_gpus} if num_gpus > 0 else {})


def check_capacity(num_bundles: int, bundle: dict[str, float], cluster: dict[str, float]) -> None:
    """Raise :class:`PlacementError` naming what was asked and what the cluster has, if it cannot hold it."""
    short = {
        key: (num_bundles * amount, cluster.get(key, 0.0))
        for key, amount in bundle.items()
        if num_bundles * amount > cluster.get(key, 0.0) + 1e-9
    }
    if short:
        asked = ", ".join(f"{key} {need:g} (has {has:g})" for key, (need, has) in short.items())
        raise PlacementError(
            f"the run needs {num_bundles} bundles of {bundle}, and the Ray cluster is too small: {asked}; "
            "lower cluster.cpu_trainer_ranks / cluster.cpu_engines (CPU) or the parallel sizes, or add nodes"
        )


def create_rank_slots(
    num_ranks: int,
    *,
    num_gpus: float,
    num_cpus: float,
    timeout_s: float = 120.0,
    name: str = "",
    on_this_node: bool = False,
) -> tuple[PlacementGroup, list[RankSlot]]:
    """Reserve one bundle per rank (PACK strategy) and return the slots sorted by (node IP, GPU ids).

    ``on_this_node``: every bundle on the caller's node (STRICT_PACK, aimed there), as a run that
    listens on 127.0.0.1 only needs.
    Raises :class:`PlacementError` at once when the cluster's total resources cannot hold the
    bundles (:func:`check_capacity`), within ``timeout_s`` when they exist but stay taken, and
    when ``on_this_node`` bundles landed elsewhere.
    """
    bundle = bundle_resources(num_gpus, num_cpus)
    check_capacity(num_ranks, bundle, ray.cluster_resources())
    group = placement_group(
        [dict(bundle) for _ in range(num_ranks)],
        strategy="STRICT_PACK" if on_this_node else "PACK",
        name=name,
        _soft_target_node_id=ray.get_runtime_context().get_node_id() if on_this_node else None,
    )
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(group)
        raise PlacementError(
            f"could not place {num_ranks} bundles of {bundle} within {timeout_s:.0f} s; "
            f"the cluster has {ray.cluster_resources()}"
        )
    probes = [
        _probe_bundle.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
            num_gpus=num_gpus,
        ).remote()
        for index in range(num_ranks)
    ]
    slots = [RankSlot(index, ip, gpus) for index, (ip, gpus) in enumerate(ray.get(probes))]
    here = ray.util.get_node_ip_address()
    if on_this_node and {slot.node_ip for slot in slots} != {here}:
        ray.util.remove_placement_group(group)
        raise PlacementError(
            f"cluster.nodes is 1, so the run listens on 127.0.0.1 only, but Ray placed its {num_ranks} bundles on "
            f"node(s) {sorted({slot.node_ip for slot in slots})} while the driver runs on {here}: run the driver on "
            "a node that holds them all, or set cluster.nodes and cluster.network_interface for a multi-node run"
        )
    return group, sorted(slots, key=lambda slot: (slot.node_ip, slot.gpu_ids, slot.bundle_index))


def engine_node_slots(slots: Sequence[RankSlot], nnodes: int = 1) -> list[list[RankSlot]]:
    """One engine's bundles (sorted as :func:`create_rank_slots` sorts them) split by node, in node order: the
    engine's processes, one per node (``nnodes`` of them).

    Raises ValueError when the bundles lie on another number of nodes than ``nnodes``, or not as many on each
    (SGLang gives every node tp_size / nnodes ranks).
    """
    nodes: dict[str, list[RankSlot]] = {}
    for slot in slots:
        nodes.setdefault(slot.node_ip, []).append(slot)
    split = list(nodes.values())
    if len(split) != nnodes or len({len(node) for node in split}) > 1:
        counts = {ip: len(node) for ip, node in nodes.items()}
        raise ValueError(
            f"an engine of {nnodes} node(s) got its {len(slots)} bundles on nodes {counts}; it needs "
            f"{len(slots) // max(nnodes, 1)} on each of {nnodes} nodes (rollout.tp x rollout.dp a multiple of "
            "cluster.gpus_per_node, or a divisor of it)"
        )
    return split


def engine_gpu_ids(slots: Sequence[RankSlot]) -> tuple[str, ...]:
    """The GPU ids Ray assigned to one node's bundles of an engine, in bundle order.

    Raises ValueError when the bundles lie on several nodes (split them with :func:`engine_node_slots` first).
    """
    (node,) = engine_node_slots(slots) if slots else [[]]
    return tuple(gpu for slot in node for gpu in slot.gpu_ids)
