"""A rollout manager built from its parts as the run builds one, for tests and benchmarks that set the parts' few
fields they are about and leave the rest at the run's defaults."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from megatron_rl.config.schema import DynamicSamplingConfig, OverlongConfig, RolloutConfig
from megatron_rl.data import PromptDataset, PromptSampler
from megatron_rl.data.rewards import ServedReward
from megatron_rl.engines.engine import RolloutEngine
from megatron_rl.rollout.engine_pool import EnginePool, Recovery
from megatron_rl.rollout.episodes import Episode
from megatron_rl.rollout.group_assembler import GroupAssembler
from megatron_rl.rollout.manager import RolloutManager, StepPolicy
from megatron_rl.rollout.submissions import SubmissionPlanner


def build_manager(
    engines: Sequence[RolloutEngine],
    dataset: PromptDataset,
    sampler: PromptSampler,
    rollout: RolloutConfig,
    overlong: OverlongConfig,
    dynamic_sampling: DynamicSamplingConfig,
    *,
    prompts_per_step: int,
    reward: str,
    reward_num_workers: int,
    reward_timeout_s: float,
    decode: Callable[[list[int]], str],
    served_reward: ServedReward | None = None,
    routing_replay: bool = False,
    uid_prefix: str = "g",
    seed: int | None = None,
    recover: Recovery | None = None,
    max_token_lag: int | None = None,
    early_batches: bool = True,
    episode: Episode | None = None,
) -> RolloutManager:
    """The manager of these parts' settings (``RolloutManager``'s parts, spelled out)."""
    pool = EnginePool(engines, rollout.max_concurrent_requests, recover)
    planner = SubmissionPlanner(
        dataset,
        sampler,
        rollout,
        pool.next_engine,
        uid_prefix=uid_prefix,
        seed=seed,
        routing_replay=routing_replay,
        stop_token_ids=episode.stop_token_ids if episode is not None else (),
    )
    assembler = GroupAssembler(
        overlong,
        dynamic_sampling,
        rollout.max_response_length,
        reward=reward,
        reward_num_workers=reward_num_workers,
        reward_timeout_s=reward_timeout_s,
        decode=decode,
        served_reward=served_reward,
    )
    policy = StepPolicy(prompts_per_step, dynamic_sampling, max_token_lag, early_batches)
    return RolloutManager(pool, planner, assembler, policy, episode)
