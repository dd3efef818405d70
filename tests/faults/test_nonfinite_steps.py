"""NaN gradients in the tiny CPU run: the update is skipped and counted; too many in a row stop the run.

The fault is injected in the trainer processes (``MEGATRON_RL_FAULT_NONFINITE_UPDATES``, see
``megatron_rl/actor/fault_injection.py``): on the listed update attempts one gradient element is NaN
after the backward pass, so the global gradient norm is NaN on every rank.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.actor.fault_injection import NONFINITE_UPDATES_ENV

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _train(tmp_path: Path, poisoned: str, *overrides: str) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    command = [sys.executable, "-m", "megatron_rl.cli", "train", str(ROOT / "recipes" / "tiny_moe_cpu_dapo.yaml")]
    command += ["train.prompts_per_step=4", "algorithm.dynamic_sampling.gen_batch_prompts=16", "validation.interval=0"]
    command += ["logging.sinks=[jsonl]", *overrides]
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        NONFINITE_UPDATES_ENV: poisoned,
    }
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    metrics = tmp_path / "runs" / "tiny-moe-cpu-dapo" / "logs" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return result, records


def test_a_nan_update_is_skipped_counted_and_the_run_goes_on(tmp_path: Path) -> None:
    result, records = _train(tmp_path, "2", "train.steps=3")
    assert result.returncode == 0, result.stderr[-4000:]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["train/nonfinite_updates"] for r in records] == [0, 1, 0]
    assert [r["actor/update_skipped"] for r in records] == [0.0, 1.0, 0.0]
    assert records[1]["actor/grad_norm"] is None  # NaN, which the JSON lines sink writes as null
    assert math.isfinite(records[2]["actor/grad_norm"])
    # the skipped update left the weights finite: the next step's log-probs and loss are
    assert math.isfinite(records[2]["actor/loss"]) and records[2]["actor/mismatch_abs_max"] < 1e-3
    checkpoints = tmp_path / "runs" / "tiny-moe-cpu-dapo" / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_000003"


@pytest.mark.full  # CI skips and counts a NaN update (the test above); this is the stop after too many
def test_too_many_nan_steps_in_a_row_stop_the_run_naming_the_step_and_metric(tmp_path: Path) -> None:
    result, records = _train(tmp_path, "1,2,3", "train.steps=4", "train.max_consecutive_bad_steps=2")
    assert result.returncode != 0
    assert "step 2: 2 steps in a row had updates skipped for NaN/Inf gradients" in result.stderr, result.stderr[-3000:]
    assert "train/nonfinite_updates = 1" in result.stderr and "actor/grad_norm = nan" in result.stderr
    assert "train.max_consecutive_bad_steps=2" in result.stderr
    assert [r["step"] for r in records] == [1, 2]  # both bad steps were logged before the stop
