"""The RL driver: one loop, every line a named phase.

Per step: take the step's rollout (generated, scored, shaped, filtered) -> advantages -> shard
(each data-parallel rank gets only its samples, ragged and compact) -> train (old and reference
log-probs computed on the ranks and kept there; scalars come back) -> wait for the generation
ahead -> weight sync -> periodic validation -> metrics -> periodic checkpoint. The rollout comes
from a :class:`~megatron_rl.orchestration.rollout_pipeline.RolloutPipeline`: with
``train.max_staleness`` 0 it is generated when the step starts, with the weights of the last sync
(on-policy); with s > 0 it was generated while an earlier step trained, with the weights after step
j-s-1 (a fixed schedule, so runs stay deterministic), and the rollouts generated ahead are saved
with each checkpoint. A step's metrics are written before its checkpoint, so a
run killed after the commit has them all; the checkpoint's own wall time is in the
next step's record (``time/checkpoint_s``). With colocated engines the run's
hand-over (:mod:`memory_handover`) moves memory between the phases: engines
release theirs after generation and the actor reloads; after training the actor
offloads its optimizer state, engines resume weights, the sync runs, the actor
offloads its parameters and engines resume their KV cache before validation.
A checkpoint reloads the actor the same way; the next step (or validation) re-syncs
before generating. Each move is timed as ``time/<move>_s``.

Checkpoints (under ``cfg.checkpoint_dir``) are written into a staging directory
and committed by rename with ``latest`` written last: trainer state (step,
sampler state, weight version), the Megatron model/optimizer/schedule shards and
every rank's RNG states, plus ``hf_metadata/`` (config and tokenizer) so that
``megatron-rl convert mcore-to-hf --ckpt <checkpoint dir>`` exports the latest
one. With ``checkpoint.export_hf`` each checkpoint also holds ``hf/``: a Hugging
Face model directory (safetensors, sharded with ``model.safetensors.index.json``
when the trainer has several writing ranks; config.json, generation config,
tokenizer) with the same tensors that converter writes, loadable by
``transformers`` and the reference engine. ``checkpoint.resume: auto`` continues
from ``latest``.

A checkpoint records the trainer layout it was saved at; resuming at another TP/PP/EP
layout reshards the weights and optimizer state exactly, and reseeds every rank's
generators from ``train.seed + step`` (generator states belong to the ranks that saved them).
Before anything starts, a resume checks that the checkpoint holds the recipe's model.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.checkpoint import TrainerState, load_trainer_state
from megatron_rl.checkpoint.layout import CARRIED_OVER_FILE
from megatron_rl.checkpoint.run_checkpoint import (
    check_same_adapter,
    check_same_model,
    checkpoint_to_resume,
    save_run_checkpoint,
)
from megatron_rl.config import RunConfig, describe_layout, layout_record
from megatron_rl.config.schema import CheckpointConfig, TrainConfig
from megatron_rl.orchestration.batch_assembly import (
    assemble_step_data,
    delivery_metrics,
    group_advantages,
    rollout_metrics,
    trim_to_even_split,
)
from megatron_rl.orchestration.errors import NonFiniteTrainingError
from megatron_rl.orchestration.preemption import PreemptionRequest, preemption_requests, record_stopped_early
from megatron_rl.orchestration.resources import RunResources, max_token_lag, start_run
from megatron_rl.orchestration.rollout_pipeline import (
    CarriedOver,
    RolloutPipeline,
    load_carried_over,
    save_carried_over,
)
from megatron_rl.rollout.groups import RolloutGroup, weight_version_number


def should_checkpoint(checkpoint: CheckpointConfig, train: TrainConfig, step: int) -> bool:
    """Save after every ``checkpoint.interval`` steps and after the last one."""
    return step == train.steps or (checkpoint.interval > 0 and step % checkpoint.interval == 0)


class PhaseTimer:
    """Wall seconds per named phase of one step, as ``time/<phase>_s`` metrics."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[f"time/{phase}_s"] = time.perf_counter() - start


def finished_run_notice(cfg: RunConfig, checkpoint: Path, step: int) -> str | None:
    """What to print instead of starting anything when ``checkpoint`` (at ``step``) already ends the run."""
    if step < cfg.train.steps:
        return None
    return (
        f"# {cfg.name} is finished: {checkpoint} holds step {step} of train.steps={cfg.train.steps}; nothing to do.\n"
        f"# To continue it, raise train.steps (e.g. train.steps={step + cfg.train.steps}); to start over, set "
        "checkpoint.resume=none (or another checkpoint.dir)."
    )


@dataclass(frozen=True)
class RunEnd:
    """Where :func:`train` left the run: its checkpoint directory and the last step trained and saved."""

    checkpoint_dir: Path
    last_step: int


def refuse_unbuilt(cfg: RunConfig) -> None:
    """Raise ValueError for what ``validate`` and ``plan`` accept but training does not run yet (issue 40 builds
    LoRA in slices): ``lora:`` on GPU trainer ranks, whose Transformer Engine layers get no adapters yet, and
    ``lora.experts_shared_outer``."""
    if cfg.lora is None:
        return
    if cfg.cluster.gpus_per_node > 0:
        raise ValueError(
            "lora: LoRA training on GPUs is not built yet (issue 40: adapters on Transformer Engine's layers come "
            "next); the recipe is validated and planned, and trains on CPU (cluster.gpus_per_node=0); remove the "
            "lora section to train every parameter"
        )
    if cfg.lora.experts_shared_outer:
        raise ValueError(
            "lora.experts_shared_outer: true is not built yet (issue 40): set lora.experts_shared_outer=false "
            "(every expert its own A and B)"
        )


def train(cfg: RunConfig) -> RunEnd:
    """Run (or continue) the recipe's RL job to ``train.steps``.

    A run whose checkpoint already holds ``train.steps`` says so and returns before Ray starts.
    SIGTERM or SIGUSR1 (:mod:`preemption`) ends the run early: the step in progress finishes,
    its checkpoint is saved, and ``last_step`` says which step that is (below ``train.steps``).
    Refuses what :func:`refuse_unbuilt` refuses, before anything starts.
    """
    refuse_unbuilt(cfg)
    resume_from = checkpoint_to_resume(cfg)
    state = load_trainer_state(resume_from) if resume_from else TrainerState(step=0, sampler={}, weight_version=0)
    if resume_from:
        check_same_model(cfg, resume_from)
        check_same_adapter(cfg, state, resume_from)
        notice = finished_run_notice(cfg, resume_from, state.step)
        if notice is not None:
            print(notice, flush=True)
            return RunEnd(Path(cfg.checkpoint_dir), state.step)
    last_step = cfg.train.steps
    with preemption_requests() as preemption:
        run = start_run(cfg, resume_step=state.step if resume_from else -1)  # a fresh run drops old records
        pipeline = None
        try:
            print(run.placement_notice(), flush=True)
            carried = restore(run, resume_from, state) if resume_from else CarriedOver([], [])
            run.rollout.restore_unfinished(carried.unfinished)
            pipeline = RolloutPipeline(
                run.rollout.generate_step,
                max_staleness=cfg.train.max_staleness,
                last_step=cfg.train.steps,
                carried=carried.rollouts,
            )
            if state.step == 0 and not preemption.requested and (before := validate(run, 0)):
                run.logger.log(0, before)
            checkpoint_seconds: dict[str, float] = {}
            bad_steps = 0
            for step in range(state.step + 1, cfg.train.steps + 1):
                if preemption.requested:
                    notice = stopped_notice(preemption, step - 1, cfg.train.steps)
                    print(notice, flush=True)
                    record_stopped_early(notice)
                    last_step = step - 1
                    break
                metrics = train_one_step(run, step, pipeline)
                run.logger.log(step, metrics | checkpoint_seconds)
                checkpoint_seconds = {}
                bad_steps = count_bad_steps(metrics, bad_steps, step, cfg.train.max_consecutive_bad_steps)
                if should_checkpoint(cfg.checkpoint, cfg.train, step) or preemption.requested:
                    started = time.perf_counter()
                    run.hand_over.to_training()  # the engines get the weights back at the next to_rollout
                    save_checkpoint(run, step, CarriedOver(pipeline.carried_over(), run.rollout.unfinished_groups()))
                    checkpoint_seconds = {"time/checkpoint_s": time.perf_counter() - started}
            else:
                if preemption.requested:
                    print(
                        f"# {preemption.signal_name} arrived during the last step; the run is finished "
                        f"(step {cfg.train.steps} of {cfg.train.steps} is saved)",
                        flush=True,
                    )
        finally:
            if pipeline is not None:
                pipeline.close()
            run.close()
    return RunEnd(Path(cfg.checkpoint_dir), last_step)


def count_bad_steps(metrics: dict[str, float], previous: int, step: int, limit: int) -> int:
    """Consecutive steps, up to ``step``, with an update skipped for non-finite gradients (0 after a clean step).

    Raises NonFiniteTrainingError naming the step and the metrics once ``limit`` is reached.
    """
    if not metrics.get("train/nonfinite_updates"):
        return 0
    bad = previous + 1
    if bad >= limit:
        raise NonFiniteTrainingError(
            f"step {step}: {bad} steps in a row had updates skipped for NaN/Inf gradients "
            f"(train/nonfinite_updates = {metrics['train/nonfinite_updates']:g}, actor/grad_norm = "
            f"{metrics.get('actor/grad_norm', float('nan')):g}, actor/loss = {metrics.get('actor/loss', float('nan')):g}); "
            f"train.max_consecutive_bad_steps={limit}. The checkpoints written so far are kept; check the data "
            "and the learning rate, or resume from an earlier checkpoint (checkpoint.resume=PATH)"
        )
    return bad


def stopped_notice(preemption: PreemptionRequest, step: int, steps: int) -> str:
    """What the driver prints when it stops for a pre-emption signal after ``step`` (0: before any step)."""
    where = f"the checkpoint of step {step} is saved" if step else "no step was trained in this start"
    return (
        f"# stopped for {preemption.signal_name} after step {step} of {steps}: {where}; "
        "started again, the run resumes from its latest checkpoint"
    )


def train_one_step(run: RunResources, step: int, pipeline: RolloutPipeline) -> dict[str, float]:
    """Take the step's rollout -> advantages -> shard -> train (old/ref log-probs on the ranks) -> sync ->
    validate; metrics.

    The rollout comes from ``pipeline`` (:mod:`rollout_pipeline`): generated now (synchronous loop), or
    generated earlier, while step k+s is generated in the background during training and waited for
    before the sync. A partial step (dynamic sampling's ``train_partial``) trains on the groups that
    split evenly over mini-batches x DP ranks (``rollout/groups_trimmed`` counts the rest); a step left
    with no group skips its update (``train/update_skipped`` is 1) and the run goes on.
    """
    cfg, timer, started = run.cfg, PhaseTimer(), time.perf_counter()
    judge_restarts = run.recover_judge()  # before the step's responses are scored
    run.hand_over.to_rollout(timer)
    with timer("generate"):
        rollout = pipeline.take(step).rollout
    run.hand_over.to_training(timer)
    unit = cfg.train.mini_batches_per_step * run.trainers.data_parallel_size
    groups = trim_to_even_split(rollout.groups, unit)
    metrics = rollout.metrics | {
        "rollout/groups_trimmed": float(len(rollout.groups) - len(groups)),
        "train/update_skipped": float(not groups),
    }
    if run.judge is not None:
        metrics["rollout/judge_restarts"] = float(judge_restarts)
    if rollout.groups:
        metrics |= rollout_metrics(rollout.groups, max_response_length=cfg.rollout.max_response_length)
        metrics |= staleness_metrics(rollout.groups, trained_version=step - 1, max_lag=max_token_lag(cfg))
    tokens = 0.0
    if groups:
        train_metrics, tokens = _train_on(run, groups, timer)
        metrics |= train_metrics
    with timer("wait_generation"):
        pipeline.wait_ahead()
    if run.deferred_recovery is not None:  # engines restarted beside training get this sync's weights
        run.rollout.use_engines(run.deferred_recovery.before_sync())
    run.hand_over.sync_weights(step, timer)
    run.hand_over.to_rollout(timer)
    generated_s = pipeline.generated_s
    if any(validation_set.due(step, cfg.train.steps) for validation_set in run.validation):
        with timer("validate"):
            metrics |= validate(run, step)
    step_seconds = time.perf_counter() - started
    idle = {
        "time/trainer_idle_s": timer.seconds["time/generate_s"] + timer.seconds["time/wait_generation_s"],
        "time/engine_idle_s": max(0.0, step_seconds - generated_s),
    }
    return metrics | timer.seconds | idle | {"time/step_s": step_seconds, "perf/tokens_per_s": tokens / step_seconds}


def staleness_metrics(groups: list[RolloutGroup], *, trained_version: int, max_lag: int) -> dict[str, float]:
    """How many weight versions the step's samples lag behind ``trained_version``, the policy they train.

    A sample's version is the ``weight_version`` its engine reported for its last tokens (``default``:
    the initial weights, 0). ``async/staleness_mean`` and ``async/staleness_max``, and the histogram as
    ``async/samples_at_staleness_<k>`` for k = 0..``max_lag``. Per token (a partial rollout's
    response holds tokens of several versions): ``async/token_staleness_mean`` and
    ``async/token_staleness_max``, and ``async/partial_samples``, the samples with tokens of more than
    one version. Raises RuntimeError for a token staler than ``max_lag`` (``train.max_staleness``, plus
    ``partial_rollout_max_windows - 1`` with partial rollouts: the pipeline's schedule and the rollout
    manager's stale-group rule never make one).
    """
    samples = [s for group in groups for s in group.samples]
    lags = [trained_version - weight_version_number(s.weight_version) for s in samples]
    histogram = {f"async/samples_at_staleness_{k}": float(lags.count(k)) for k in range(max_lag + 1)}
    token_lags = [
        (trained_version - weight_version_number(version), count)
        for s in samples
        for version, count in s.token_versions()
    ]
    oldest = max((lag for lag, count in token_lags if count), default=0)
    if oldest > max_lag:
        raise RuntimeError(
            f"a token of step {trained_version + 1} is {oldest} weight versions old, beyond the bound of "
            f"{max_lag} (train.max_staleness, plus rollout.partial_rollout_max_windows - 1 with partial rollouts)"
        )
    tokens = sum(count for _, count in token_lags)
    per_token = {
        "async/token_staleness_mean": sum(lag * count for lag, count in token_lags) / tokens if tokens else 0.0,
        "async/token_staleness_max": float(oldest),
        "async/partial_samples": float(sum(len({v for v, _ in s.token_versions()}) > 1 for s in samples)),
    }
    return (
        histogram | per_token | {"async/staleness_mean": sum(lags) / len(lags), "async/staleness_max": float(max(lags))}
    )


def _train_on(run: RunResources, groups: list[RolloutGroup], timer: PhaseTimer) -> tuple[dict[str, float], float]:
    """Advantages, one shard per DP rank, and the update (old/ref log-probs on the ranks); metrics and tokens."""
    algorithm = run.cfg.algorithm
    with timer("shard"):
        advantages = group_advantages(
            groups, estimator=algorithm.advantage_estimator, norm_by_std=algorithm.norm_adv_by_std
        )
        step_data = assemble_step_data(groups, advantages, expert_dtype=run.expert_dtype)
        shards = step_data.shard(run.trainers.data_parallel_size, run.cfg.train.mini_batches_per_step)
    with timer("train"):
        actor_metrics, receipts = run.trainers.train_step(shards)
    metrics = {f"actor/{name}": value for name, value in actor_metrics.items()}
    metrics["train/nonfinite_updates"] = round(actor_metrics["update_skipped"] * actor_metrics["num_updates"])
    return metrics | delivery_metrics(step_data, receipts, data_parallel_size=len(shards)), float(step_data.num_tokens)


def validate(run: RunResources, step: int) -> dict[str, float]:
    """The metrics of every validation set due after ``step`` (0: before training), under the current weights:
    ``val/<set>/mean@<n>``, ``pass@<k>``, ``maj@<k>``, ... (:meth:`ValidationSet.run`).

    Empty when no set is due. Engines are made ready to generate first.
    """
    due = [validation_set for validation_set in run.validation if validation_set.due(step, run.cfg.train.steps)]
    if not due:
        return {}
    run.hand_over.to_rollout()
    return {key: value for validation_set in due for key, value in validation_set.run(step).items()}


def save_checkpoint(run: RunResources, step: int, carried: CarriedOver) -> Path:
    """Write and commit the run checkpoint of ``step`` (see :mod:`megatron_rl.checkpoint.layout`), with the
    rollouts generated for later steps and the unfinished partial-rollout groups (``carried``:
    ``carried_over.pt``)."""
    layout = layout_record(run.cfg.parallel, run.cfg.cluster, run.cfg.rollout)
    state = TrainerState(
        step=step,
        sampler=run.rollout.sampler.state_dict(),
        weight_version=step,
        carried_over=CARRIED_OVER_FILE if carried else None,
        layout=layout,
        lora=run.cfg.lora.model_dump(mode="json") if run.cfg.lora is not None else None,
    )

    def write(staging: Path) -> None:
        save_carried_over(staging, carried)
        run.trainers.save_checkpoint(staging)

    return save_run_checkpoint(
        run.cfg.checkpoint_dir,
        state,
        hf_dir=run.hf_dir,
        tokenizer=run.data.tokenizer,
        write_rank_state=write,
        export_hf=run.trainers.export_hf if run.cfg.checkpoint.export_hf else None,
        keep_last=run.cfg.checkpoint.keep_last,
    )


def restore(run: RunResources, checkpoint: Path, state: TrainerState) -> CarriedOver:
    """Load ``checkpoint`` into every rank, restore the sampler and give the engines the restored weights;
    what it carried over (rollouts generated for later steps, not yet trained on; unfinished groups).

    At the saved layout every rank's generator states are restored (bitwise-exact resume); at
    another layout the shards are resharded and generators reseeded from ``train.seed + step``.
    """
    layout = layout_record(run.cfg.parallel, run.cfg.cluster, run.cfg.rollout)
    if state.layout is None or state.layout == layout:
        run.trainers.load_checkpoint(checkpoint)
    else:
        print(
            f"# resume: {checkpoint.name} was saved at {describe_layout(state.layout)}; continuing at "
            f"{describe_layout(layout)}: weights and optimizer state resharded, generators reseeded",
            flush=True,
        )
        run.trainers.load_checkpoint(checkpoint, reseed=run.cfg.train.seed + state.step)
    run.rollout.sampler.load_state_dict(state.sampler)
    run.hand_over.sync_weights(state.weight_version)
    return load_carried_over(checkpoint, state.carried_over)
