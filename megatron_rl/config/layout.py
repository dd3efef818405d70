"""Layouts derived from a recipe: trainer ranks and data-parallel sizes, rollout and judge engines' count and size."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config.schema import ClusterConfig, ParallelConfig, RolloutConfig, RunConfig


@dataclass(frozen=True)
class TrainerLayout:
    """Rank counts of the trainer.

    ``world_size = tp * pp * cp * dp`` for dense layers and
    ``world_size = etp * ep * expert_dp * pp`` for expert layers (Megatron-core's
    two decompositions of the same ranks). ``dp`` and ``expert_dp`` are 0 when
    the world size does not divide; :mod:`megatron_rl.config.checks` reports that.
    """

    world_size: int
    dp: int
    expert_dp: int


def trainer_world_size(cluster: ClusterConfig, rollout: RolloutConfig) -> int:
    """Trainer ranks: all GPUs when colocated, the GPUs engines do not take when disaggregated, else CPU ranks."""
    if cluster.gpus_per_node == 0:
        return cluster.cpu_trainer_ranks
    total = cluster.nodes * cluster.gpus_per_node
    if rollout.placement == "disaggregated":
        return total - (rollout.num_gpus or 0)
    return total


def trainer_layout(parallel: ParallelConfig, cluster: ClusterConfig, rollout: RolloutConfig) -> TrainerLayout:
    """The :class:`TrainerLayout` of a recipe's sections."""
    world = trainer_world_size(cluster, rollout)
    model_parallel = parallel.tp * parallel.pp * parallel.cp
    expert_parallel = parallel.expert_tp * parallel.ep * parallel.pp
    dp = world // model_parallel if world > 0 and world % model_parallel == 0 else 0
    expert_dp = world // expert_parallel if world > 0 and world % expert_parallel == 0 else 0
    return TrainerLayout(world_size=world, dp=dp, expert_dp=expert_dp)


@dataclass(frozen=True)
class EngineLayout:
    """Rollout engines of a run: how many, and the GPUs each takes (0 on CPU recipes).

    GPU recipes: each engine takes ``rollout.tp * rollout.dp`` GPUs; the engines share
    all GPUs of the job when colocated and take ``rollout.num_gpus`` of them when
    disaggregated. CPU recipes run ``cluster.cpu_engines`` reference engines.
    ``num_engines`` is 0 when the GPUs do not divide; :mod:`megatron_rl.config.checks` reports that.
    """

    num_engines: int
    gpus_per_engine: int


def engine_layout(cluster: ClusterConfig, rollout: RolloutConfig) -> EngineLayout:
    """The :class:`EngineLayout` of a recipe's sections."""
    if cluster.gpus_per_node == 0:
        return EngineLayout(num_engines=cluster.cpu_engines, gpus_per_engine=0)
    per_engine = rollout.tp * rollout.dp
    total = cluster.nodes * cluster.gpus_per_node
    pool = (rollout.num_gpus or 0) if rollout.placement == "disaggregated" else total
    return EngineLayout(num_engines=pool // per_engine if pool % per_engine == 0 else 0, gpus_per_engine=per_engine)


def layout_record(parallel: ParallelConfig, cluster: ClusterConfig, rollout: RolloutConfig) -> dict[str, int]:
    """The trainer's rank layout as plain numbers, as checkpoints record it.

    Keys: ``tp``, ``pp``, ``vpp`` (1 without interleaving), ``cp``, ``ep``, ``etp`` (resolved) and
    ``world_size``, and ``first_stage_layers`` / ``last_stage_layers`` of an uneven pipeline (absent
    when even, so records of even runs stay as they were). Two runs with equal records place every
    parameter shard and generator on the same global rank.
    """
    record = {
        "tp": parallel.tp,
        "pp": parallel.pp,
        "vpp": parallel.vpp or 1,
        "cp": parallel.cp,
        "ep": parallel.ep,
        "etp": parallel.expert_tp,
        "world_size": trainer_world_size(cluster, rollout),
    }
    for name in ("first_stage_layers", "last_stage_layers"):
        if (layers := getattr(parallel, name)) is not None:
            record[name] = layers
    return record


def describe_layout(record: dict[str, int]) -> str:
    """``tp2 pp1 vpp1 cp1 ep1 etp2 (2 ranks)`` for a :func:`layout_record`."""
    sizes = " ".join(f"{key}{record[key]}" for key in ("tp", "pp", "vpp", "cp", "ep", "etp"))
    return f"{sizes} ({record['world_size']} ranks)"


@dataclass(frozen=True)
class JudgeLayout:
    """Where a recipe's judge engines run: ``num_engines`` of ``gpus_per_engine`` GPUs (0 on CPU recipes) on
    ``nodes`` nodes of their own (0 on CPU recipes, where they share the job's node)."""

    num_engines: int
    gpus_per_engine: int
    nodes: int

    @property
    def gpus(self) -> int:
        """GPUs the judge engines take in all."""
        return self.num_engines * self.gpus_per_engine


def judge_layout(cfg: RunConfig) -> JudgeLayout:
    """The :class:`JudgeLayout` of a recipe's ``judge`` section (no engines without one). On GPU recipes the judge's
    GPUs round up to whole nodes (:attr:`RunConfig.judge_nodes`); validation refuses a judge that does not fill
    them."""
    judge = cfg.judge
    if judge is None:
        return JudgeLayout(num_engines=0, gpus_per_engine=0, nodes=0)
    gpus_per_engine = judge.tp if cfg.cluster.gpus_per_node else 0
    return JudgeLayout(judge.num_engines, gpus_per_engine, nodes=cfg.judge_nodes)
