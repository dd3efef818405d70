"""`megatron-rl smoke` on every shipped recipe, in a fresh copy of recipes/ with nothing downloaded:
two steps of the recipe's own settings on CPU, the second resumed from the first's checkpoint."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.tiny_runs import ROOT, run_env

IN_CI = {"qwen3_30b_a3b_dapo_long"}
"""Smoked in CI: the context-parallel 30B recipe (CP4 at its own layout), which shares the flagship's base (the
flagship's smoke, the command README quotes, runs in the full tier with every other recipe's)."""
RECIPES = [
    pytest.param(path, id=path.stem, marks=() if path.stem in IN_CI else pytest.mark.full)
    for path in sorted((ROOT / "recipes").glob("*.yaml"))
]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_smoke_runs_the_recipe_for_two_steps_with_a_resume(recipe: Path, tmp_path: Path) -> None:
    shutil.copytree(ROOT / "recipes", tmp_path / "recipes")
    command = [sys.executable, "-m", "megatron_rl.cli", "smoke", f"recipes/{recipe.name}"]
    result = subprocess.run(
        command, cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "# smoke: rollout.engine=reference" in result.stdout and "# smoke passed" in result.stdout
    (run_dir,) = (tmp_path / "runs").iterdir()
    records = [json.loads(line) for line in (run_dir / "logs/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["step"] > 0] == [1, 2]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_000001", "step_000002"]
