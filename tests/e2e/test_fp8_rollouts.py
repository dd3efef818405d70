"""FP8 rollouts end to end on the tiny recipe: the run converts its FP8 checkpoint, the engine serves FP8 weights
through every sync, and the policy still learns, with the rollout/train mismatch FP8 adds in its metrics.

Each sync's bytes (FP8 weights and scales equal to the blockwise quantisation of the trainer's export, per
transport) are checked in ``tests/unit/test_reference_engine_fp8.py``; here the runs, per transport.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.e2e.tiny_runs import RUN, TWO_STEPS, read_metrics, run_train

FP8 = ["rollout.quantization=fp8", "rollout.fp8_block_size=[32,32]", "logging.sinks=[jsonl]"]
pytestmark = pytest.mark.slow


def _mismatch(records: list[dict[str, float]]) -> list[float]:
    return [r["actor/mismatch_abs_mean"] for r in records if "actor/mismatch_abs_mean" in r]


@pytest.mark.full
def test_fp8_rollouts_learn_with_their_mismatch_logged(tmp_path: Path) -> None:
    """80 steps (about 5 minutes on 2 cores); greedy validation before, at 40 and at 80. The fp32 trainer and an
    fp32 engine agree to fp32 rounding (mean mismatch at most 2e-7 on the default run), so what FP8 adds is
    the mismatch here, from 1e-3 up."""
    stdout = run_train(tmp_path, [*FP8, "train.steps=80", "validation.interval=40", "checkpoint.interval=0"])
    assert "# FP8 rollouts: converting" in stdout and (tmp_path / RUN / "rollout_fp8" / "config.json").is_file()
    records = read_metrics(tmp_path / RUN)
    accuracy = [r["val/greedy/mean@1"] for r in records if "val/greedy/mean@1" in r]
    assert len(accuracy) == 3 and accuracy[-1] > accuracy[0], accuracy
    mismatch = _mismatch(records)
    assert len(mismatch) == 80 and all(0 < m < 0.1 and math.isfinite(m) for m in mismatch), mismatch


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param([], id="tensor"),
        pytest.param(
            ["rollout.placement=disaggregated", "weight_sync.transport=distributed"],
            id="distributed",
            marks=pytest.mark.full,
        ),
        pytest.param(["weight_sync.transport=disk"], id="disk", marks=pytest.mark.full),
    ],
)
def test_fp8_rollouts_run_through_every_transport(tmp_path: Path, overrides: list[str]) -> None:
    run_train(tmp_path, [*TWO_STEPS, *FP8, *overrides])
    mismatch = _mismatch(read_metrics(tmp_path / RUN))
    assert len(mismatch) == 2 and all(m > 0 for m in mismatch), mismatch
