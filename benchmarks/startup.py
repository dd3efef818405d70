"""What a user waits for on every short run: a 1-step tiny run's wall time, this tree against a baseline commit.

Runs the same command with each tree's ``megatron_rl`` (and its own ``recipes/``) first on PYTHONPATH, in a fresh
folder each time, alternating baseline and this tree ``--repeats`` times so that both see the same machine load:

    megatron-rl train recipes/tiny_moe_cpu_dapo.yaml train.steps=1 validation.interval=0 checkpoint.interval=0

and, alone, the driver's imports (``import megatron_rl.orchestration.driver`` in a fresh interpreter). The
baseline is extracted from this repository's history with ``git archive`` (``--baseline``: the commit before the
start-up cuts of issue 37). Prints the medians and the ratio this tree / baseline.

    PYTHONPATH=. .venv/bin/python benchmarks/startup.py [--baseline ba5de85] [--repeats 3]
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from benchmarks.tables import print_table

ROOT = Path(__file__).resolve().parents[1]
ONE_STEP = ["train.steps=1", "validation.interval=0", "checkpoint.interval=0", "logging.sinks=[jsonl]"]


def one_step(code: Path) -> list[str]:
    """:data:`ONE_STEP` as ``code``'s recipes spell it: trees before named validation sets had ``train.val_interval``."""
    old = "val_interval" in (code / "recipes" / "base" / "tiny_moe_cpu.yaml").read_text()
    return [o.replace("validation.interval", "train.val_interval") if old else o for o in ONE_STEP]


def extract(commit: str, into: Path) -> Path:
    """``commit``'s files, extracted from this repository with ``git archive`` into ``into``."""
    git = shutil.which("git")
    if git is None:
        raise SystemExit("git is not installed: cannot extract the baseline commit")
    archive = subprocess.run(
        [git, "-C", str(ROOT), "archive", "--format=tar", commit], capture_output=True, check=False
    )
    if archive.returncode != 0:
        raise SystemExit(f"this checkout has no commit {commit!r} (a shallow clone?): {archive.stderr.decode()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into


def _env(code: Path) -> dict[str, str]:
    return os.environ | {"PYTHONPATH": str(code)}  # ahead of the editable install's finder


def timed(command: list[str], code: Path, cwd: Path) -> float:
    """Wall seconds of ``command`` run to completion in ``cwd`` with ``code``'s megatron_rl; fails on an error."""
    started = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, env=_env(code), capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} (code {code}) failed:\n{result.stderr[-3000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="ba5de85", help="commit to compare with (default: before issue 37)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each tree, alternating (default 3)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="startup-") as scratch:
        trees = {"baseline": extract(args.baseline, Path(scratch, "baseline")), "this tree": ROOT}
        imports: dict[str, list[float]] = {name: [] for name in trees}
        runs: dict[str, list[float]] = {name: [] for name in trees}
        for repeat in range(args.repeats):
            for name, code in trees.items():
                cwd = Path(tempfile.mkdtemp(prefix=f"run-{repeat}-", dir=scratch))
                imports[name].append(
                    timed([sys.executable, "-c", "import megatron_rl.orchestration.driver"], code, cwd)
                )
                recipe = code / "recipes" / "tiny_moe_cpu_dapo.yaml"
                command = [sys.executable, "-m", "megatron_rl.cli", "train", str(recipe), *one_step(code)]
                runs[name].append(timed(command, code, cwd))

    base_run = statistics.median(runs["baseline"])
    rows = [
        [
            name,
            args.baseline if name == "baseline" else "working tree",
            f"{statistics.median(imports[name]):.2f}",
            f"{statistics.median(runs[name]):.1f}",
            " ".join(f"{s:.1f}" for s in runs[name]),
            f"{statistics.median(runs[name]) / base_run:.3f}",
        ]
        for name in trees
    ]
    print_table(["code", "commit", "driver import s", "1-step run s (median)", "runs s", "/ baseline"], rows)
    ratio = statistics.median(runs["this tree"]) / base_run
    print(f"1-step tiny run, this tree / baseline {args.baseline}: {ratio:.3f}x ({args.repeats} runs each)")


if __name__ == "__main__":
    main()
