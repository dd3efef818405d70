"""Synchronous vs one-step off-policy loop on the tiny async recipe: step time and who waits for whom.

Runs ``recipes/tiny_moe_cpu_dapo_async.yaml`` (disaggregated: one trainer rank and one reference
engine, a core each on a 2-core box) twice, at ``train.max_staleness`` 0 (the synchronous loop:
generate, then train) and 1 (step k+1 generated while step k trains), same seed and steps, runs
interleaved ``--repeats`` times. Per mode, over the steps 2..N-1 (the first has no generation ahead
of it, the last none to overlap): the median step time, the trainer's idle fraction (waiting for
generation, ``time/trainer_idle_s``), the engine's idle fraction (``time/engine_idle_s``: no
generation running), trained tokens per second; then the ratio of the step times.

    .venv/bin/python benchmarks/async_overlap.py --steps 20 --repeats 2

Not a test: the numbers depend on the machine and its load; the ratio is measured in one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny_moe_cpu_dapo_async.yaml"


def run(staleness: int, steps: int, seed: int, work: Path) -> list[dict[str, float]]:
    """One training run at ``staleness``; its per-step metric records (validation off, no checkpoints kept)."""
    run_dir = work / f"staleness{staleness}"
    command = [sys.executable, "-m", "megatron_rl.cli", "train", str(RECIPE), f"train.max_staleness={staleness}"]
    command += [f"train.steps={steps}", f"train.seed={seed}", "validation.interval=0", "checkpoint.interval=0"]
    command += [f"checkpoint.dir={run_dir / 'checkpoints'}", f"logging.dir={run_dir / 'logs'}", "logging.sinks=[jsonl]"]
    command += ["checkpoint.resume=none"]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    records = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if 1 < r["step"] < steps]


def summarize(records: list[dict[str, float]]) -> dict[str, float]:
    """Median step seconds, trainer and engine idle fractions, trained tokens per second."""
    step_s = [r["time/step_s"] for r in records]
    return {
        "step_s": statistics.median(step_s),
        "trainer_idle": sum(r["time/trainer_idle_s"] for r in records) / sum(step_s),
        "engine_idle": sum(r["time/engine_idle_s"] for r in records) / sum(step_s),
        "tokens_per_s": statistics.median(r["perf/tokens_per_s"] for r in records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    results: dict[int, list[dict[str, float]]] = {0: [], 1: []}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for staleness in (0, 1):
                work = Path(scratch) / f"repeat{repeat}"
                results[staleness].append(summarize(run(staleness, args.steps, args.seed, work)))
    print(f"tiny async recipe, {args.steps} steps (steps 2..{args.steps - 1} counted), {args.repeats} repeats\n")
    print("| max_staleness | step s (median) | trainer idle | engine idle | trained tokens/s |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    summary = {}
    for staleness, runs in results.items():
        summary[staleness] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        row = summary[staleness]
        print(
            f"| {staleness} | {row['step_s']:.3f} | {row['trainer_idle']:.0%} | {row['engine_idle']:.0%} | "
            f"{row['tokens_per_s']:.0f} |"
        )
    ratio = summary[0]["step_s"] / summary[1]["step_s"]
    print(f"\nstep time, synchronous / one-step off-policy: {ratio:.2f}x")


if __name__ == "__main__":
    main()
