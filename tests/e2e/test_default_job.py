"""The README's default-job command runs as written (two short steps of the default recipe)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_default_job_command_trains_and_says_what_it_ran(tmp_path: Path) -> None:
    overrides = [
        "train.steps=2",
        "train.prompts_per_step=4",
        "algorithm.dynamic_sampling.gen_batch_prompts=16",  # random init: over-sample to find groups with signal
        "validation.interval=0",
        f"checkpoint.dir={tmp_path / 'checkpoints'}",
        f"logging.dir={tmp_path / 'logs'}",
        "logging.sinks=[console,jsonl]",
    ]
    result = subprocess.run(
        [str(ROOT / "launch" / "run.sh"), *overrides], capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "[run] megatron-rl train recipes/tiny_moe_cpu_dapo.yaml train.steps=2" in result.stdout
    assert "# done: 2 steps" in result.stdout
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
