"""DAPO vs Dr.GRPO vs GRPO on the tiny synthetic task, over several seeds: runs them and prints the report tables.

Each (recipe, seed) is one ``megatron-rl train recipes/tiny_moe_cpu_<algorithm>.yaml
train.seed=<seed> name=<algorithm>-seed<seed>`` run in ``runs/`` (a finished run is read, not
rerun), so any single number in the report can be reproduced with that one command. Prints
markdown: greedy validation accuracy and reward by step (mean and min..max over seeds) and the
training samples' length-bias diagnostics at the last step and the groups dynamic sampling
dropped over the run (means over seeds). Draws the greedy validation accuracy of every
algorithm and seed against the step into ``--plot`` (PNG, matplotlib).

    python scripts/compare_algorithms.py --seeds 1234 1 2
    python scripts/compare_algorithms.py --algorithms DAPO "DAPO async" --plot docs/images/async-comparison.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALGORITHMS = {"DAPO": "dapo", "Dr.GRPO": "drgrpo", "GRPO": "grpo"}
VARIANTS = ALGORITHMS | {"DAPO async": "dapo_async"}
"""Every recipe the script can run, by label: ``--algorithms`` picks among them (default: ALGORITHMS)."""
DIAGNOSTICS = {
    "train accuracy": "train/accuracy",
    "mean length": "train/response_length_mean",
    "correct mean length": "train/length_correct_mean",
    "wrong mean length": "train/length_wrong_mean",
    "wrong / correct ratio": "train/length_wrong_over_correct",
    "length-score correlation": "train/length_score_corr",
}


def run_name(algorithm: str, seed: int) -> str:
    """The run's ``name`` (and directory under ``runs/``)."""
    return f"{algorithm}-seed{seed}"


def metrics(algorithm: str, seed: int) -> list[dict[str, float]]:
    """The run's metric records; trains it first unless ``runs/<name>`` already finished."""
    run_dir = ROOT / "runs" / run_name(algorithm, seed)
    path = run_dir / "logs" / "metrics.jsonl"
    recipe = ROOT / "recipes" / f"tiny_moe_cpu_{algorithm}.yaml"
    command = [sys.executable, "-m", "megatron_rl.cli", "train", str(recipe)]
    command += [f"train.seed={seed}", f"name={run_name(algorithm, seed)}", "logging.sinks=[jsonl]"]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)  # resumes or returns at once when done
    return [json.loads(line) for line in path.read_text().splitlines()]


def spread(values: list[float]) -> str:
    """``mean (min..max)`` with two decimals; a lone value alone."""
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ({min(values):.2f}..{max(values):.2f})"


def plot_validation(records: dict[str, list[list[dict[str, float]]]], seeds: list[int], path: Path) -> None:
    """One panel per algorithm: greedy validation accuracy against the step, one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(records), figsize=(4 * len(records), 3.2), sharey=True)
    for axis, (label, runs) in zip(axes, records.items(), strict=True):
        for seed, run in zip(seeds, runs, strict=True):
            points = [(r["step"], r["val/greedy/mean@1"]) for r in run if "val/greedy/mean@1" in r]
            axis.plot(*zip(*points, strict=True), marker="o", markersize=3, label=f"seed {seed}")
        axis.set_title(label)
        axis.set_xlabel("step")
        axis.set_ylim(-0.02, 1.02)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("greedy validation accuracy")
    axes[0].legend(loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "images" / "algorithm-comparison.png")
    parser.add_argument("--algorithms", nargs="+", choices=list(VARIANTS), default=list(ALGORITHMS))
    args = parser.parse_args()
    chosen = {label: VARIANTS[label] for label in args.algorithms}
    records = {label: [metrics(algo, seed) for seed in args.seeds] for label, algo in chosen.items()}

    val_steps = sorted({r["step"] for runs in records.values() for r in runs[0] if "val/greedy/reward_mean" in r})
    for title, key in (("accuracy", "val/greedy/mean@1"), ("reward", "val/greedy/reward_mean")):
        print(f"Greedy validation {title}, mean (min..max) over seeds {args.seeds}:\n")
        print("| step | " + " | ".join(chosen) + " |")
        print("| --- |" + " --- |" * len(chosen))
        for step in val_steps:
            cells = [
                spread([r[key] for run in runs for r in run if r["step"] == step and key in r])
                for runs in records.values()
            ]
            print(f"| {step} | " + " | ".join(cells) + " |")
        print()
    plot_validation(records, args.seeds, args.plot)
    print(f"Validation curves: {args.plot.relative_to(ROOT) if args.plot.is_relative_to(ROOT) else args.plot}")

    print("\nTraining samples at the last step, mean over seeds:\n")
    print("| | " + " | ".join(chosen) + " |")
    print("| --- |" + " --- |" * len(chosen))
    for label, key in DIAGNOSTICS.items():
        cells = []
        for runs in records.values():
            values = [run[-1][key] for run in runs if run[-1].get(key) is not None]
            cells.append(f"{statistics.mean(values):.2f}" if values else "n/a")
        print(f"| {label} | " + " | ".join(cells) + " |")
    dropped = [
        statistics.mean(sum(r.get("rollout/groups_dropped", 0) for r in run) for run in runs)
        for runs in records.values()
    ]
    print("| groups dropped, all steps | " + " | ".join(f"{value:.1f}" for value in dropped) + " |")


if __name__ == "__main__":
    main()
