"""Validation sets: one rollout manager per named set, which sets a step validates, and each set's metrics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_rl.algorithms import metrics_at_k
from megatron_rl.config.schema import DynamicSamplingConfig, OverlongConfig, RunConfig, ValidationSetConfig
from megatron_rl.data import PromptSampler
from megatron_rl.data.preparation import PreparedData
from megatron_rl.data.rewards import ServedReward
from megatron_rl.engines.engine import RolloutEngine
from megatron_rl.rollout.engine_pool import EnginePool, Recovery
from megatron_rl.rollout.episodes import Episode
from megatron_rl.rollout.group_assembler import GroupAssembler
from megatron_rl.rollout.groups import RolloutGroup, RolloutStep
from megatron_rl.rollout.manager import RolloutManager, StepPolicy
from megatron_rl.rollout.policy_adapter import PolicyAdapter
from megatron_rl.rollout.submissions import SubmissionPlanner

FAILURE_COUNTS = ("reward_errors", "reward_timeouts", "engine_restarts")
"""Rollout counters each set reports as its own: responses whose reward failed, engines restarted meanwhile."""


@dataclass
class ValidationSet:
    """A named set, its recipe section, how often training validates it (0: never) and its manager."""

    name: str
    config: ValidationSetConfig
    interval: int
    manager: RolloutManager

    def due(self, step: int, total_steps: int) -> bool:
        """Whether the run validates this set after ``step`` (0: before training): every ``interval`` steps and
        after the last one."""
        return self.interval > 0 and (step % self.interval == 0 or step == total_steps)

    def generate(self, step: int) -> RolloutStep:
        """The whole set generated and scored under the engines' current weights, after training step ``step``.

        Request ids and seeds follow from ``step`` alone (the sampler is set to epoch ``step``), so the
        validation of a step draws the same samples in a straight run, a resumed one and ``eval`` of that step's
        checkpoint, and no two validations of a run share a request id.
        """
        self.manager.sampler.load_state_dict({"epoch": step, "position": 0, "seed": 0})
        return self.manager.generate_step()

    def run(self, step: int) -> dict[str, float]:
        """:meth:`generate` after ``step``, as ``val/<name>/<metric>``."""
        return self.metrics_of(self.generate(step))

    def metrics_of(self, step: RolloutStep) -> dict[str, float]:
        """The ``val/<name>/<metric>`` metrics of the set's generated ``step``: :func:`set_metrics` and the
        failure counts."""
        failures = {key: step.metrics[f"rollout/{key}"] for key in FAILURE_COUNTS}
        metrics = set_metrics(step.groups, self.config.ks) | failures
        return {f"val/{self.name}/{key}": value for key, value in metrics.items()}

    def close(self) -> None:
        """Stop the set's reward workers."""
        self.manager.close()


def set_metrics(groups: Sequence[RolloutGroup], ks: Sequence[int]) -> dict[str, float]:
    """mean@n, pass@k and maj@k for each of ``ks`` (:func:`~megatron_rl.algorithms.metrics_at_k`), the reward's
    mean, response lengths (mean and max, in tokens, environment replies included) and the fraction of responses
    cut at the length limit, over every response of ``groups`` (one group per prompt, each of the same n)."""
    samples = [sample for group in groups for sample in group.samples]
    lengths = [len(sample.response_ids) for sample in samples]
    at_k = metrics_at_k([[(sample.answer, sample.correct) for sample in group.samples] for group in groups], ks)
    return at_k | {
        "reward_mean": sum(sample.score for sample in samples) / len(samples),
        "response_length_mean": sum(lengths) / len(lengths),
        "response_length_max": float(max(lengths)),
        "truncated_fraction": sum(sample.truncated for sample in samples) / len(samples),
    }


def build_validation_sets(
    cfg: RunConfig,
    data: PreparedData,
    engines: Sequence[RolloutEngine],
    *,
    names: Sequence[str] | None = None,
    recover: Recovery | None = None,
    episode: Episode | None = None,
    served_reward: ServedReward | None = None,
    adapter: PolicyAdapter | None = None,
) -> list[ValidationSet]:
    """A manager per set: ``names`` (None: the sets training validates, those of interval > 0), in recipe order.

    Each call of a set's manager generates its whole set, ``n`` responses per prompt sampled as the set says,
    unshaped, unfiltered, each response whole (no partial-rollout windows), in the training rollout's
    ``episode``; ``recover`` restarts crashed engines; ``served_reward`` scores as in training (a reward server's
    or the judge's scorer); ``adapter``: a LoRA run's, named by every request. Raises ValueError for a name the recipe does not define or
    a set without prompts (no files of its own and no ``data.val_files``).
    """
    sets = cfg.validation.sets
    chosen = [name for name in sets if cfg.validation.interval_of(name) > 0] if names is None else list(names)
    for name in chosen:
        if name not in sets:
            raise ValueError(f"validation set {name!r} is not in the recipe; its sets are {sorted(sets)}")
        if name not in data.val_sets:
            raise ValueError(
                f"validation.sets.{name}: no prompts (no files of its own and no data.val_files); give it files"
            )
    return [
        ValidationSet(
            name,
            sets[name],
            cfg.validation.interval_of(name),
            _set_manager(
                cfg, data, name, engines, recover=recover, episode=episode, served_reward=served_reward, adapter=adapter
            ),
        )
        for name in chosen
    ]


def validation_seed(cfg: RunConfig, name: str) -> int:
    """The sampling seed of set ``name``: ``train.seed`` + 1 + the set's place in the recipe, so no set draws with the
    training rollout's seeds or another set's."""
    return cfg.train.seed + 1 + list(cfg.validation.sets).index(name)


def _set_manager(
    cfg: RunConfig,
    data: PreparedData,
    name: str,
    engines: Sequence[RolloutEngine],
    *,
    recover: Recovery | None,
    episode: Episode | None,
    served_reward: ServedReward | None,
    adapter: PolicyAdapter | None,
) -> RolloutManager:
    validation_set, dataset = cfg.validation.sets[name], data.val_sets[name]
    rollout = cfg.rollout.model_copy(
        update={
            "temperature": validation_set.temperature,
            "top_p": validation_set.top_p,
            "top_k": validation_set.top_k,
            "n_samples_per_prompt": validation_set.n,
            "max_response_length": validation_set.max_response_length or cfg.rollout.max_response_length,
            "partial_rollout_tokens": None,
        }
    )
    sampler = PromptSampler(len(dataset), len(dataset), shuffle=False)
    pool = EnginePool(engines, rollout.max_concurrent_requests, recover)
    planner = SubmissionPlanner(
        dataset,
        sampler,
        rollout,
        pool.next_engine,
        uid_prefix=f"val-{name}-",
        seed=validation_seed(cfg, name),
        routing_replay=False,
        stop_token_ids=episode.stop_token_ids if episode is not None else (),
        adapter=adapter,
    )
    assembler = GroupAssembler(
        OverlongConfig(enable=False),
        DynamicSamplingConfig(enable=False),
        rollout.max_response_length,
        reward=cfg.data.reward,
        reward_num_workers=1,
        reward_timeout_s=cfg.data.reward_timeout_s,
        decode=data.decode,
        served_reward=served_reward,
    )
    return RolloutManager(
        pool, planner, assembler, StepPolicy(len(dataset), DynamicSamplingConfig(enable=False)), episode
    )
