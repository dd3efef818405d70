"""Where a run's trainer ranks and rollout engines go: one placement group, a plan over its bundles.

:func:`plan_run_placement` is pure (recipe in, plan out; this module imports no Ray, so
``megatron-rl plan`` uses it); :mod:`megatron_rl.orchestration.resources` reserves the bundles
on Ray and resolves the plan's positions to bundles.

Bundles are identical and, once reserved, sorted by (node IP, GPU ids) (see
:func:`~megatron_rl.orchestration.placement_group.create_rank_slots`); the plan names
positions in that order, so what shares a node is contiguous:

- GPU, colocated: one ``{GPU: 1, CPU: 1}`` bundle per GPU of the job. Trainer rank
  ``r`` takes a share of bundle ``r``; engine ``e`` uses the GPUs of bundles
  ``e*k .. e*k+k-1`` (``k = rollout.tp * rollout.dp``) and its host actor takes a
  smaller share of the first of them (slime shares bundles the same way).
- GPU, disaggregated: the same bundles; the trainer ranks take the first
  ``world_size`` whole, the engines group the rest ``k`` at a time.
- CPU: one ``{CPU: 0.4}`` bundle per trainer rank, then one per engine (there is
  no device to share; ``colocated`` still selects the memory hand-over and the
  tensor transport): 4 trainer ranks and an engine fit a 2-core machine. Colocated
  on several nodes, each node's trainer ranks are followed by its engines, so an
  engine sits on the node of the trainer ranks that feed it
  (:func:`~megatron_rl.weight_sync.engine_feeds.colocated_feeds`).

Validation (:mod:`megatron_rl.config.checks`) guarantees that ``k`` divides the GPUs
per node, or is a whole number of nodes (an engine spanning nodes: its bundles are the
whole of ``k / gpus_per_node`` consecutive nodes, ``engine_nodes``), and divides the engines'
GPU count, so no engine straddles a node partially;
:func:`~megatron_rl.orchestration.placement_group.engine_node_slots` re-checks it on the bundles
Ray actually gave.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config import RunConfig, engine_layout, judge_layout, trainer_layout

CPU_BUNDLE_CPUS = 0.4
"""Ray CPUs per bundle on CPU recipes (a scheduling token: the processes share the machine's cores); 4 trainer
ranks plus one engine take 2.0, so they fit a 2-core machine."""
COLOCATED_TRAINER_SHARE = 0.5
"""Share of a colocated bundle's GPU and CPU a trainer rank's actor takes."""
ENGINE_HOST_SHARE = 0.25
"""Share of its first bundle's GPU and CPU an engine host actor takes (GPU recipes)."""


class PlacementError(RuntimeError):
    """The cluster cannot hold the requested bundles; the message says what was asked and what exists."""


@dataclass(frozen=True)
class ActorResources:
    """The Ray resources one actor asks of its bundle."""

    num_gpus: float
    num_cpus: float


@dataclass(frozen=True)
class RunPlacementPlan:
    """Bundles to reserve and, as positions in their sorted order, where each trainer rank and engine goes."""

    num_bundles: int
    bundle: ActorResources
    trainer_positions: tuple[int, ...]
    engine_positions: tuple[tuple[int, ...], ...]
    trainer: ActorResources
    engine_host: ActorResources
    engine_nodes: int = 1
    """Nodes each engine spans (its bundles on that many consecutive nodes, one process per node)."""


def plan_run_placement(cfg: RunConfig) -> RunPlacementPlan:
    """The placement of ``cfg``'s trainer ranks and engines (see the module docstring).

    Raises ValueError when the recipe's engine layout does not divide its GPUs (``validate`` reports it first).
    """
    world = trainer_layout(cfg.parallel, cfg.cluster, cfg.rollout).world_size
    engines = engine_layout(cfg.cluster, cfg.rollout)
    if engines.num_engines == 0:
        raise ValueError(
            f"rollout.tp x rollout.dp = {engines.gpus_per_engine} GPUs per engine does not divide the rollout GPUs; "
            "run `megatron-rl validate` on the recipe"
        )
    if cfg.cluster.gpus_per_node == 0:
        cpu = ActorResources(num_gpus=0.0, num_cpus=CPU_BUNDLE_CPUS)
        nodes = cfg.cluster.nodes if cfg.rollout.placement == "colocated" else 1
        ranks, count = world // nodes, engines.num_engines // nodes  # per node (validate: they divide)
        return RunPlacementPlan(
            num_bundles=world + engines.num_engines,
            bundle=cpu,
            trainer_positions=tuple(n * (ranks + count) + r for n in range(nodes) for r in range(ranks)),
            engine_positions=tuple((n * (ranks + count) + ranks + e,) for n in range(nodes) for e in range(count)),
            trainer=cpu,
            engine_host=cpu,
        )
    total = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    colocated = cfg.rollout.placement == "colocated"
    first_engine_gpu = 0 if colocated else world
    size = engines.gpus_per_engine
    share = COLOCATED_TRAINER_SHARE if colocated else 1.0
    return RunPlacementPlan(
        num_bundles=total,
        bundle=ActorResources(num_gpus=1.0, num_cpus=1.0),
        trainer_positions=tuple(range(world)),
        engine_positions=tuple(
            tuple(range(first_engine_gpu + e * size, first_engine_gpu + (e + 1) * size))
            for e in range(engines.num_engines)
        ),
        trainer=ActorResources(num_gpus=share, num_cpus=share),
        engine_host=ActorResources(num_gpus=ENGINE_HOST_SHARE, num_cpus=ENGINE_HOST_SHARE),
        engine_nodes=max(1, size // cfg.cluster.gpus_per_node),
    )


def plan_judge_placement(cfg: RunConfig) -> RunPlacementPlan | None:
    """The judge engines' own placement group (None without ``judge``): on GPU recipes one ``{GPU: 1, CPU: 1}``
    bundle per judge GPU, engine ``e`` on bundles ``e*tp .. e*tp+tp-1`` (its nodes: :attr:`RunConfig.judge_nodes`
    beside the run's); on CPU recipes one ``{CPU: 0.4}`` bundle per engine. No trainer ranks."""
    layout = judge_layout(cfg)
    if layout.num_engines == 0:
        return None
    if cfg.cluster.gpus_per_node == 0:
        cpu = ActorResources(num_gpus=0.0, num_cpus=CPU_BUNDLE_CPUS)
        return RunPlacementPlan(
            num_bundles=layout.num_engines,
            bundle=cpu,
            trainer_positions=(),
            engine_positions=tuple((e,) for e in range(layout.num_engines)),
            trainer=ActorResources(num_gpus=0.0, num_cpus=0.0),
            engine_host=cpu,
        )
    size = layout.gpus_per_engine
    return RunPlacementPlan(
        num_bundles=layout.gpus,
        bundle=ActorResources(num_gpus=1.0, num_cpus=1.0),
        trainer_positions=(),
        engine_positions=tuple(tuple(range(e * size, (e + 1) * size)) for e in range(layout.num_engines)),
        trainer=ActorResources(num_gpus=0.0, num_cpus=0.0),
        engine_host=ActorResources(num_gpus=ENGINE_HOST_SHARE, num_cpus=ENGINE_HOST_SHARE),
    )
