"""Exact resume: a run killed with SIGKILL after its first checkpoint and started again ends as the straight run.

Both runs: the tiny DAPO recipe, 4 steps, a checkpoint every 2 steps. The second run's
process group is killed as soon as ``latest`` exists, then the same command runs again and
resumes from it. Asserted: identical per-step metrics (all but wall-clock ones) and
bit-identical final Megatron checkpoint shards (model and optimizer).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = ["train.steps=4", "train.prompts_per_step=4", "train.val_interval=2", "checkpoint.interval=2"]
OVERRIDES += ["data.synthetic.num_val=16", "logging.sinks=[jsonl]"]
WALL_CLOCK_PREFIXES = ("time/", "perf/", "rollout/seconds", "actor/time_")


def _command() -> list[str]:
    recipe = str(ROOT / "recipes" / "tiny_moe_cpu_dapo.yaml")
    return [sys.executable, "-m", "megatron_rl.cli", "train", recipe, *OVERRIDES]


def _env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _run(cwd: Path) -> None:
    result = subprocess.run(_command(), cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-4000:]


def _run_killed_after_first_checkpoint(cwd: Path) -> None:
    latest = cwd / "runs" / "tiny-moe-cpu-dapo" / "checkpoints" / "latest"
    process = subprocess.Popen(
        _command(), cwd=cwd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + 600
    while not latest.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert process.poll() is None and latest.exists(), "the run ended (or timed out) before its first checkpoint"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _metrics(run_dir: Path) -> list[dict[str, float]]:
    records = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK_PREFIXES)} for r in records]


def _shards(run_dir: Path) -> dict[str, bytes]:
    megatron = run_dir / "checkpoints" / "step_000004" / "megatron"
    return {p.name: p.read_bytes() for p in sorted(megatron.glob("*.distcp"))}


@pytest.mark.slow
def test_killed_and_resumed_run_matches_the_straight_run(tmp_path: Path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir(), resumed.mkdir()
    _run(straight)
    _run_killed_after_first_checkpoint(resumed)
    _run(resumed)

    run = Path("runs") / "tiny-moe-cpu-dapo"
    straight_metrics, resumed_metrics = _metrics(straight / run), _metrics(resumed / run)
    assert [r["step"] for r in resumed_metrics] == [0, 1, 2, 3, 4]
    for expected, actual in zip(straight_metrics, resumed_metrics, strict=True):
        assert actual == expected, f"step {expected['step']} differs"
    straight_shards = _shards(straight / run)
    assert straight_shards and straight_shards == _shards(resumed / run)
