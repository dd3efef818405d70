"""The tiny run's orchestration overhead: the share of each step spent outside model compute.

Runs the tiny CPU recipe's steps with the driver's own step function (``train_one_step``: Ray,
the reference engines, 2 trainer ranks, weight sync, validation every ``--val-interval``
steps) and splits every step's wall time into phases with their model compute:

* ``generate`` / ``validate``: wall ``time/generate_s`` / ``time/validate_s``; compute = the
  engines' forward-pass seconds in that phase, read from their ``GET /metrics`` counter
  (``sglang:forward_execution_seconds_total``, SGLang's) before and after the phase;
* ``train``: wall ``time/train_s`` (the driver's call into the ranks); compute = the ranks'
  ``actor/time_old_log_probs_s`` (+ ``time_ref_log_probs_s``) + per update
  ``time_forward_backward_s`` + ``time_update_s`` (the optimizer step), times ``num_updates``;
* everything else (``shard``, ``weight_sync``, the colocated hand-over moves, what no phase
  covers): no model compute.

Overhead share = 1 - compute / wall, per phase and for the step. The benchmark's own probes (the
two ``GET /metrics`` per engine and phase, inside the phase's wall time) are timed and taken out
of that phase's and the step's wall time: they are measurement, not the run. Steps after the first
``--warmup`` are summarised (medians per step). The goal (issue 15) is an overhead under 10%. A
second table splits the ``rest`` into the driver's timed moves (``time/<move>_s``).

    PYTHONPATH=. .venv/bin/python benchmarks/orchestration_overhead.py [--steps 20] [--warmup 2] [overrides ...]

The last line states the step's median overhead share and whether the goal is met.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.tables import print_table
from megatron_rl.config import load_recipe
from megatron_rl.engines.http_engine import HttpEngine
from megatron_rl.engines.protocol import FORWARD_SECONDS_METRIC, IDLE_SECONDS_METRIC, metric_total
from megatron_rl.orchestration.driver import train_one_step
from megatron_rl.orchestration.resources import RunResources, start_run
from megatron_rl.orchestration.rollout_pipeline import RolloutPipeline

RECIPE = "recipes/tiny_moe_cpu_dapo.yaml"
GOAL = 0.10


def engine_seconds(engines: list[HttpEngine]) -> tuple[float, float]:
    """(forward-pass, scheduler-idle) seconds the engines have counted so far, summed over engines."""
    texts = [engine.request("/metrics") for engine in engines]
    return sum(metric_total(t, FORWARD_SECONDS_METRIC) for t in texts), sum(
        metric_total(t, IDLE_SECONDS_METRIC) for t in texts
    )


def _counted(phase: Callable, engines: list[HttpEngine], into: dict[str, float], key: str) -> Callable:
    """``phase`` counting the engines' forward and idle seconds in it, and the wall seconds of those probes."""

    def run(*args, **kwargs):
        probe_started = time.perf_counter()
        forward, idle = engine_seconds(engines)
        started = time.perf_counter()
        try:
            return phase(*args, **kwargs)
        finally:
            ended = time.perf_counter()
            forward_after, idle_after = engine_seconds(engines)
            into[key] = into.get(key, 0.0) + forward_after - forward
            into[f"{key}_idle"] = into.get(f"{key}_idle", 0.0) + idle_after - idle
            probes = started - probe_started + time.perf_counter() - ended
            into[f"{key}_probe"] = into.get(f"{key}_probe", 0.0) + probes

    return run


def _instrument(run: RunResources, forward: dict[str, float]) -> None:
    """Count the engines' forward seconds of every generation (training) and validation call."""
    engines: list[HttpEngine] = []
    for engine in run.engines:
        assert isinstance(engine, HttpEngine), f"{engine.name}: the benchmark reads /metrics over HTTP"
        engines.append(engine)
    # the benchmark wraps the managers' own methods (on these instances), which mypy reads as assigning to a method
    run.rollout.generate_step = _counted(run.rollout.generate_step, engines, forward, "generate")  # type: ignore[method-assign]
    for validation_set in run.validation:
        manager = validation_set.manager
        manager.generate_step = _counted(manager.generate_step, engines, forward, "validate")  # type: ignore[method-assign]


def _phases(metrics: dict[str, float], forward: dict[str, float]) -> dict[str, tuple[float, float]]:
    """(wall, compute) seconds per phase of one step, the benchmark's probes taken out of the walls."""
    updates = metrics.get("actor/num_updates", 0.0)
    train_compute = (
        metrics.get("actor/time_old_log_probs_s", 0.0)
        + metrics.get("actor/time_ref_log_probs_s", 0.0)
        + updates * (metrics.get("actor/time_forward_backward_s", 0.0) + metrics.get("actor/time_update_s", 0.0))
    )
    generate_probe, validate_probe = forward.get("generate_probe", 0.0), forward.get("validate_probe", 0.0)
    phases = {
        "generate": (metrics["time/generate_s"] - generate_probe, forward.get("generate", 0.0)),
        "train": (metrics.get("time/train_s", 0.0), train_compute),
        "validate": (metrics.get("time/validate_s", 0.0) - validate_probe, forward.get("validate", 0.0)),
    }
    step_wall = metrics["time/step_s"] - generate_probe - validate_probe
    timed = sum(wall for wall, _ in phases.values())
    phases["rest"] = (step_wall - timed, 0.0)
    phases["step"] = (step_wall, sum(compute for _, compute in phases.values()))
    return phases


PHASE_TIMES = {"time/generate_s", "time/train_s", "time/validate_s", "time/step_s"}
"""The driver's timers the phase table reads; every other ``time/<move>_s`` is part of the ``rest``."""


def _rest_moves(metrics: dict[str, float]) -> dict[str, float]:
    """The driver's timed moves outside the phases (``shard``, ``weight_sync``, hand-over moves), seconds."""
    idle = {"time/trainer_idle_s", "time/engine_idle_s"}  # derived from the phases, not moves of their own
    return {k: v for k, v in metrics.items() if k.startswith("time/") and k not in PHASE_TIMES | idle}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--val-interval", type=int, default=5)
    parser.add_argument("overrides", nargs="*", help="recipe overrides, section.field=value")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="orchestration-overhead-"))
    overrides = [
        f"train.steps={args.steps}",
        f"validation.interval={args.val_interval}",
        "checkpoint.interval=0",
        f"checkpoint.dir={work}/checkpoints",
        f"logging.dir={work}/logs",
        "logging.sinks=[jsonl]",
        *args.overrides,
    ]
    cfg, _ = load_recipe(RECIPE, overrides)
    run = start_run(cfg, resume_step=-1)
    steps: list[dict[str, tuple[float, float]]] = []
    moves: list[dict[str, float]] = []
    idle: list[float] = []
    probes: list[float] = []
    forward: dict[str, float] = {}
    _instrument(run, forward)
    pipeline = RolloutPipeline(
        run.rollout.generate_step,
        max_staleness=cfg.train.max_staleness,
        last_step=args.steps,
    )
    try:
        for step in range(1, args.steps + 1):
            forward.clear()
            started = time.perf_counter()
            metrics = train_one_step(run, step, pipeline)
            print(f"step {step}: {time.perf_counter() - started:.2f} s", flush=True)
            if step > args.warmup:
                steps.append(_phases(metrics, forward))
                moves.append(_rest_moves(metrics))
                idle.append(forward.get("generate_idle", 0.0))
                probes.append(forward.get("generate_probe", 0.0) + forward.get("validate_probe", 0.0))
    finally:
        pipeline.close()
        run.close()
    rows = []
    for phase in ("generate", "train", "validate", "rest", "step"):
        walls = [s[phase][0] for s in steps]
        computes = [s[phase][1] for s in steps]
        wall, compute = statistics.median(walls), statistics.median(computes)
        total_wall = sum(walls)
        share = 1 - sum(computes) / total_wall if total_wall > 0 else 0.0
        rows.append([phase, f"{wall:.3f}", f"{compute:.3f}", f"{total_wall - sum(computes):.2f}", f"{share:.0%}"])
    print_table(
        ["phase", "wall s/step (median)", "compute s/step (median)", "outside compute s (total)", "overhead"], rows
    )
    names = sorted({name for record in moves for name in record})
    print_table(
        ["rest: move", "wall s/step (median)", "wall s (total)"],
        [
            [
                name,
                f"{statistics.median(r.get(name, 0.0) for r in moves):.4f}",
                f"{sum(r.get(name, 0.0) for r in moves):.2f}",
            ]
            for name in names
        ],
    )
    generate_outside = sum(s["generate"][0] - s["generate"][1] for s in steps)
    print(
        f"generate, outside forward passes ({generate_outside:.2f} s in total): engines idle, no request in them "
        f"(HTTP, reward scoring, the manager between generation batches) {sum(idle):.2f} s; engines holding "
        f"requests outside forward passes (scheduling, sampling, answers) {generate_outside - sum(idle):.2f} s"
    )
    print(f"the benchmark's own /metrics probes, taken out of the walls above: {sum(probes):.2f} s in total")
    step_walls = [s["step"][0] for s in steps]
    step_share = 1 - sum(s["step"][1] for s in steps) / sum(step_walls)
    verdict = "met" if step_share < GOAL else "not met"
    print(
        f"orchestration overhead of the tiny run: {step_share:.0%} of each step outside model compute over "
        f"{len(steps)} steps (goal < {GOAL:.0%}: {verdict})"
    )


if __name__ == "__main__":
    main()
