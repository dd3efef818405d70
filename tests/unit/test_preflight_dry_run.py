"""`megatron-rl preflight --dry-run`: every shipped recipe lists its six steps and where each runs, starting nothing."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megatron_rl.cli import main
from megatron_rl.config import load_recipe
from megatron_rl.plan.placement import plan_run_placement
from megatron_rl.preflight.dry_run import process_groups
from megatron_rl.preflight.report import STEP_NAMES

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: path.stem)
def test_dry_run_lists_every_step_with_its_placement(
    recipe: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copytree(ROOT / "recipes", tmp_path / "recipes")  # config_fallback paths are relative to the folder
    monkeypatch.chdir(tmp_path)
    assert main(["preflight", f"recipes/{recipe.name}", "--dry-run"]) == 0
    out = capsys.readouterr().out
    steps = [line for line in out.splitlines() if line[:2].rstrip(".").isdigit()]
    assert [line.split(":")[0].split(". ")[1] for line in steps] == list(STEP_NAMES)
    cfg, _ = load_recipe(f"recipes/{recipe.name}", [], require_files=False)
    devices = next(line for line in steps if " devices:" in line)
    per_node = cfg.cluster.gpus_per_node
    if per_node:  # every trainer rank's node is probed
        for node in {position // per_node for position in plan_run_placement(cfg).trainer_positions}:
            assert f"node {node} GPUs 0-{per_node - 1}" in devices
    for name, groups in process_groups(cfg).items():
        assert f"{len(groups)} {name} group(s) of {len(groups[0])}" in devices
    assert "(dry run: nothing started)" in out
    assert not Path("runs").exists()  # nothing started, nothing written


def test_groups_are_megatrons_for_the_30b_layout() -> None:
    """tp 4 x dp 8 on 32 ranks, experts ep 8 x expert-dp 4: TP groups are 4 consecutive ranks, expert groups 8."""
    cfg, _ = load_recipe(ROOT / "recipes" / "qwen3_30b_a3b_dapo.yaml", [], require_files=False)
    groups = process_groups(cfg)
    assert groups["tp"][:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["ep"][0] == list(range(8))
    assert groups["dp"][0] == list(range(0, 32, 4))
    assert set(groups) == {"tp", "dp", "ep"}
    assert sorted(r for group in groups["dp"] for r in group) == list(range(32))
