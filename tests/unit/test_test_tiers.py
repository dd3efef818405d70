"""The two tiers: ``./launch/test.sh`` (CI) keeps at least one real run of every path, ``--full`` adds the rest.

Collected as pytest collects them for each command (``--collect-only``), so the markers and the deselection in
tests/conftest.py are what is checked, not a list kept beside them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ONE_REAL_RUN_OF_EVERY_PATH = {
    "synchronous training, checkpoints and metrics": "tests/e2e/test_tiny_run.py::"
    "test_three_steps_log_every_metric_and_commit_checkpoints",
    "async, partial windows, multi-turn tools, SIGKILL resume bitwise": "tests/e2e/test_exact_resume.py::"
    "test_killed_and_resumed_run_matches_the_straight_run[async-partial-tools]",
    "SIGTERM resume bitwise": "tests/faults/test_sigterm_preemption.py::"
    "test_sigterm_to_the_driver_saves_its_step_exits_0_and_resumes_as_the_uninterrupted_run",
    "the real SGLang": "tests/sglang/test_sglang_run.py::"
    "test_the_sglang_recipe_trains_with_a_logged_mismatch_and_resumes_from_its_checkpoint",
    "FP8 rollouts": "tests/e2e/test_fp8_rollouts.py::test_fp8_rollouts_run_through_every_transport[tensor]",
    "context parallelism at a recipe's layout": "tests/e2e/test_smoke_recipes.py::"
    "test_smoke_runs_the_recipe_for_two_steps_with_a_resume[qwen3_30b_a3b_dapo_long]",
    "an engine killed mid-run": "tests/faults/test_engine_restart.py::"
    "test_a_crashed_engine_is_restarted_and_the_run_ends_with_the_uninterrupted_weights[colocated]",
    "two Ray nodes": "tests/faults/test_two_nodes.py::"
    "test_an_engine_spanning_both_nodes_generates_syncs_and_restarts_whole",
    "Slurm": "tests/slurm/test_ray_on_slurm.py::test_train_sbatch_runs_the_rl_job_on_the_allocation",
}
FILES = sorted({node.split("::")[0] for node in ONE_REAL_RUN_OF_EVERY_PATH.values()})


def _collected(*options: str) -> tuple[set[str], set[str]]:
    """The node ids pytest collects with ``options``, and those of them marked ``full`` (tests/tier_probe.py)."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p", "tests.tier_probe"]
        + [*options, *FILES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line.strip() for line in result.stdout.splitlines() if "::" in line]
    marked = {line.removeprefix("full ") for line in lines if line.startswith("full ")}
    return {line for line in lines if not line.startswith("full ")}, marked


def test_ci_keeps_a_real_run_of_every_path_and_full_adds_the_rest() -> None:
    (ci, ci_marked), (full, full_only) = _collected(), _collected("--full")
    missing = {path: node for path, node in ONE_REAL_RUN_OF_EVERY_PATH.items() if node not in ci}
    assert missing == {}
    assert not ci_marked and full_only and ci | full_only == full and not ci & full_only
    recipes = sorted(path.stem for path in (ROOT / "recipes").glob("*.yaml"))
    smokes = "tests/e2e/test_smoke_recipes.py::test_smoke_runs_the_recipe_for_two_steps_with_a_resume"
    assert sorted(node.split("[")[1][:-1] for node in full if node.startswith(smokes)) == recipes
