"""Exact resume: a run killed with SIGKILL, after its first checkpoint and again while writing its second, ends as the straight run.

Both runs: the tiny DAPO recipe, 4 steps, a checkpoint every 2 steps; again with its async variant
(``train.max_staleness: 1``, disaggregated), whose checkpoints also hold the rollout generated
ahead (``carried_over.pt``), which the resumed run trains on; and again with partial rollouts
(4-token windows, dynamic sampling on score variance so that steps fill and groups still generating
are carried), whose checkpoints also hold the unfinished groups, which the resumed run continues; and that
once more in multi-turn tool episodes (the synthetic lookup task), windows cutting turns and tool
replies; and with LoRA (``recipes/tiny_moe_cpu_dapo_lora.yaml``: the checkpoints hold the frozen base, the adapter and
its optimizer state, and each sync loads the adapter into the engine). The second run's
process group is killed as soon as ``latest`` exists; the same command runs again, resumes
from it, and is killed while the step-4 checkpoint is being written (its staging directory
holds Megatron's shard directory); ``latest`` must still name the step-2 checkpoint. The
third start resumes from it and finishes. Asserted: identical per-step metrics (all but
wall-clock ones) and a bit-identical final Megatron checkpoint: every tensor of model and optimizer
equal bitwise, every other entry (optimizer groups, step counts) equal. The straight run is the session's
(``straight_runs``), which test_split_unchanged compares with the base commit's too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.e2e.tiny_runs import (
    FOUR_STEPS,
    PARTIAL_ROLLOUTS,
    RECIPE,
    ROOT,
    TOOLS,
    StraightRuns,
    megatron_contents,
    read_metrics,
    run_env,
    run_train,
    train_command,
    without_wall_clock,
)

ASYNC_RECIPE = ROOT / "recipes" / "tiny_moe_cpu_dapo_async.yaml"
LORA_RECIPE = ROOT / "recipes" / "tiny_moe_cpu_dapo_lora.yaml"
RECIPES = {
    "sync": (RECIPE, Path("runs") / "tiny-moe-cpu-dapo", []),
    "async": (ASYNC_RECIPE, Path("runs") / "tiny-moe-cpu-dapo-async", []),
    "async-partial": (ASYNC_RECIPE, Path("runs") / "tiny-moe-cpu-dapo-async", PARTIAL_ROLLOUTS),
    "async-partial-tools": (ASYNC_RECIPE, Path("runs") / "tiny-moe-cpu-dapo-async", PARTIAL_ROLLOUTS + TOOLS),
    "lora": (LORA_RECIPE, Path("runs") / "tiny-moe-cpu-dapo-lora", []),
}
IN_CI = ("async-partial-tools",)
"""CI resumes the case that holds the most state (the generation carried ahead, unfinished groups, tool turns); the
others are in the full tier (LoRA's: 208 s in CI9; CI holds its resume at the actor, tests/distributed/test_lora_actor.py)."""


def _run_killed_when(cwd: Path, recipe: Path, overrides: list[str], moment: Callable[[], bool], what: str) -> None:
    """Start the run in ``cwd`` and SIGKILL its whole process group as soon as ``moment()`` holds."""
    process = subprocess.Popen(
        train_command(overrides, recipe),
        cwd=cwd,
        env=run_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 600
    while not moment() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert process.poll() is None and moment(), f"the run ended (or timed out) before {what}"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _metrics(run_dir: Path) -> list[dict[str, float]]:
    return without_wall_clock(read_metrics(run_dir))


@pytest.mark.slow
@pytest.mark.parametrize(
    "loop", [pytest.param(loop, marks=() if loop in IN_CI else pytest.mark.full) for loop in RECIPES]
)
def test_killed_and_resumed_run_matches_the_straight_run(
    tmp_path: Path, straight_runs: StraightRuns, loop: str
) -> None:
    recipe, run, extra = RECIPES[loop]
    overrides = FOUR_STEPS + extra
    straight, resumed = straight_runs.run(recipe, overrides), tmp_path / "resumed"
    resumed.mkdir()
    checkpoints = resumed / run / "checkpoints"
    latest = checkpoints / "latest"
    _run_killed_when(resumed, recipe, overrides, latest.exists, "its first checkpoint")
    saving = checkpoints / ".staging_step_000004" / "megatron"
    _run_killed_when(resumed, recipe, overrides, saving.exists, "it wrote its second checkpoint")
    assert latest.read_text().strip() == "step_000002"
    carried_file = checkpoints / "step_000002" / "carried_over.pt"
    assert carried_file.exists() == (loop.startswith("async"))
    if loop.startswith("async-partial"):
        assert torch.load(carried_file, weights_only=False)["unfinished"], "no group was still generating"
    run_train(resumed, overrides, recipe)

    straight_metrics, resumed_metrics = _metrics(straight / run), _metrics(resumed / run)
    assert [r["step"] for r in resumed_metrics] == [0, 1, 2, 3, 4]
    assert all(r["train/update_skipped"] == 0.0 for r in straight_metrics[1:])  # every step updated the weights
    for expected, actual in zip(straight_metrics, resumed_metrics, strict=True):
        assert actual == expected, f"step {expected['step']} differs"
    if loop == "async":  # steps 2..4 trained on samples of the weights one step older
        assert [r["async/staleness_max"] for r in straight_metrics[1:]] == [0.0, 1.0, 1.0, 1.0]
    if loop.startswith("async-partial"):  # responses continued under newer weights hold tokens two versions old
        assert max(r["async/partial_samples"] for r in straight_metrics[1:]) > 0
        assert max(r["async/token_staleness_max"] for r in straight_metrics[1:]) == 2.0
    if loop == "async-partial-tools":  # multi-turn episodes whose tool replies sit in carried groups too
        assert sum(r["rollout/tool_calls"] for r in straight_metrics[1:]) > 0
    final = [megatron_contents(root / run / "checkpoints" / "step_000004", tmp_path) for root in (straight, resumed)]
    assert final[0].keys() == final[1].keys()
    for key, saved in final[0].items():
        loaded = final[1][key]
        if isinstance(saved, torch.Tensor):
            assert isinstance(loaded, torch.Tensor) and torch.equal(loaded, saved), key
        else:
            assert loaded == saved, key
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_000002", "step_000004"]
