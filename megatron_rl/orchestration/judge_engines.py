"""The judge's engines (``data.reward: judge``): a placement group of their own, hosted like rollout engines.

They load ``judge.model`` and keep it: no weight sync reaches them (they are in no hand-over's engine list), and
they take no part in the rollout's engine pool. On GPU recipes their bundles are GPUs beside the run's
(:func:`~megatron_rl.plan.placement.plan_judge_placement`: whole extra nodes), on CPU recipes scheduling tokens on
the job's node. Their engines listen on the run's network and require the run's API key, like rollout engines.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

import ray
from ray.util.placement_group import PlacementGroup

from megatron_rl.config import RunConfig
from megatron_rl.config.schema import JudgeConfig, RolloutConfig
from megatron_rl.engines.engine import EngineStartupError
from megatron_rl.orchestration.engine_host import EngineHosts, EngineSpec
from megatron_rl.orchestration.network import RunNetwork
from megatron_rl.orchestration.placement_group import create_rank_slots, engine_gpu_ids
from megatron_rl.plan.placement import plan_judge_placement
from megatron_rl.rollout.judge_reward import JudgeReward

logger = logging.getLogger(__name__)

JUDGE_ENGINE_PREFIX = "judge"
"""Judge engines are named ``judge0``, ``judge1``, ... (their log files too)."""


def judge_rollout_config(cfg: RunConfig) -> RolloutConfig:
    """The engine settings of ``cfg``'s judge engines: the rollout's, with the judge's engine kind, TP size, KV cache
    and request timeout; no FP8 rollout checkpoint, one data-parallel replica, no expert parallelism."""
    judge = cfg.judge
    assert judge is not None, "judge_rollout_config needs a judge section"
    return cfg.rollout.model_copy(
        update={
            "engine": judge.engine or cfg.rollout.engine,
            "tp": judge.tp,
            "ep": 1,
            "dp": 1,
            "quantization": None,
            "fp8_checkpoint": None,
            "max_total_tokens": judge.max_total_tokens or cfg.rollout.max_total_tokens,
            "request_timeout_s": judge.request_timeout_s,
        }
    )


@dataclass
class JudgeEngines:
    """The judge's running engines; :meth:`reward` is the served reward that asks them."""

    judge: JudgeConfig
    placement: PlacementGroup
    hosts: EngineHosts
    api_key: str | None
    restarts: list[int] = field(init=False)
    """Restarts of each engine so far."""

    def __post_init__(self) -> None:
        self.restarts = [0] * self.judge.num_engines

    def reward(self) -> JudgeReward:
        """A :class:`JudgeReward` asking these engines, once every one is healthy (EngineStartupError naming the
        judge engine that failed otherwise, every engine then stopped)."""
        self.hosts.wait_healthy()
        return JudgeReward(self.judge, self.hosts.addresses, self.api_key)

    def recover(self, max_restarts: int) -> int:
        """Restart every judge engine whose process has ended, each at most ``max_restarts`` times in the run; how
        many were restarted now (their addresses change: make a new :meth:`reward`).

        A restart that fails is logged and leaves the engine down: its requests go to the other judge engines (or
        fail as reward errors), and it is tried again at the next call while its budget lasts.
        """
        restarted = 0
        for index, running in enumerate(self.hosts.running()):
            if running or self.restarts[index] >= max_restarts:
                continue
            self.restarts[index] += 1
            name = self.hosts.addresses[index][0]
            try:
                self.hosts.restart(index)
            except EngineStartupError as error:
                logger.warning(
                    "judge engine %s did not restart (try %d of %d): %s",
                    name,
                    self.restarts[index],
                    max_restarts,
                    error,
                )
                continue
            logger.warning(
                "judge engine %s had stopped; restarted (%d of %d)", name, self.restarts[index], max_restarts
            )
            restarted += 1
        return restarted

    def close(self) -> None:
        """Stop the engines and release their placement group."""
        with contextlib.suppress(Exception):
            self.hosts.close()
        ray.util.remove_placement_group(self.placement)


def start_judge_engines(cfg: RunConfig, network: RunNetwork, api_key: str | None) -> JudgeEngines | None:
    """Reserve the judge's bundles and start its engines (None without a judge); :meth:`JudgeEngines.reward` waits
    for them, so they start while the rest of the run does.

    Raises PlacementError when the cluster cannot hold the judge's bundles; nothing is left reserved then.
    """
    plan = plan_judge_placement(cfg)
    if plan is None or cfg.judge is None:
        return None
    placement, slots = create_rank_slots(
        plan.num_bundles,
        num_gpus=plan.bundle.num_gpus,
        num_cpus=plan.bundle.num_cpus,
        name=f"{cfg.name}-judge",
        on_this_node=network.is_loopback,
    )
    try:
        rollout = judge_rollout_config(cfg)
        base = EngineSpec(
            name="",
            kind=rollout.engine,
            model_path=str(Path(cfg.judge.model).resolve()),
            log_dir=str(Path(cfg.log_dir).resolve()),
            rollout=rollout,
            seed=cfg.train.seed,
            network=network,
            api_key=api_key,
        )
        specs, bundles = [], []
        for index, positions in enumerate(plan.engine_positions):
            gpus = engine_gpu_ids([slots[p] for p in positions]) if cfg.cluster.gpus_per_node else ()
            specs.append(replace(base, name=f"{JUDGE_ENGINE_PREFIX}{index}", gpu_ids=gpus))
            bundles.append(slots[positions[0]].bundle_index)
        hosts = EngineHosts(specs, placement, bundles, plan.engine_host)
    except BaseException:
        ray.util.remove_placement_group(placement)
        raise
    return JudgeEngines(cfg.judge, placement, hosts, api_key)
