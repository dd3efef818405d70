"""Every path the driver hands a Ray actor is absolute, resolved against the driver's working directory: an actor
on another node has a working directory of its own, where the recipe's relative paths (``runs/<name>/...``) would
name other folders. Built through the functions start_run uses, without Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.config import load_recipe
from megatron_rl.config.schema import RolloutConfig
from megatron_rl.orchestration.engine_host import EngineSpec
from megatron_rl.orchestration.network import RunNetwork
from megatron_rl.orchestration.placement_group import RankSlot
from megatron_rl.orchestration.resources import engine_specs
from megatron_rl.orchestration.trainer_group import TrainerGroup
from megatron_rl.orchestration.trainer_worker import RankPaths, TrainerWorker
from megatron_rl.plan.placement import plan_run_placement
from tests.tiny_checkpoints import save_tiny_moe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@pytest.fixture
def driver_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The driver's working directory, a fresh one: the recipe's relative paths lie under it."""
    monkeypatch.chdir(tmp_path)
    return tmp_path.resolve()


def test_engine_specs_name_the_model_and_log_folders_absolute(driver_dir: Path) -> None:
    cfg, _ = load_recipe(RECIPES / "tiny_moe_cpu_dapo.yaml", ["cluster.cpu_engines=2", "logging.dir=logs/mine"])
    hf_dir = Path(cfg.run_dir, "initial_hf")  # relative, as initial_weights returns it for a random_init recipe
    save_tiny_moe(hf_dir)
    plan = plan_run_placement(cfg)
    slots = [RankSlot(index, "10.0.0.1", ()) for index in range(plan.num_bundles)]
    specs, _ = engine_specs(cfg, hf_dir, slots, plan, RunNetwork())
    nodes = [spec for engine in specs for spec in engine]
    assert len(nodes) == 2
    assert {spec.model_path for spec in nodes} == {str(driver_dir / cfg.run_dir / "initial_hf")}
    assert {spec.log_dir for spec in nodes} == {str(driver_dir / "logs" / "mine")}


@pytest.mark.parametrize("recipe", ["qwen3_30b_a3b_dapo", "qwen3_30b_a3b_dapo_fp8"])
def test_a_trainer_ranks_folders_are_absolute(driver_dir: Path, qwen3_30b_overrides: list[str], recipe: str) -> None:
    cfg, _ = load_recipe(RECIPES / f"{recipe}.yaml", qwen3_30b_overrides, require_files=False)
    paths = RankPaths.of(cfg, Path(cfg.run_dir, "initial_hf"))
    run_dir = driver_dir / cfg.run_dir
    assert paths.hf_dir == str(run_dir / "initial_hf") and paths.weight_sync_dir == str(run_dir / "weight_sync")
    engine_config = run_dir / "rollout_fp8" if cfg.rollout.quantization == "fp8" else run_dir / "initial_hf"
    assert paths.engine_config_dir == str(engine_config)


def test_relative_paths_are_refused_where_actors_take_them() -> None:
    with pytest.raises(ValueError, match=r"RankPaths takes absolute paths .*'weight_sync_dir': 'runs/x/weight_sync'"):
        RankPaths("/runs/x/initial_hf", "runs/x/weight_sync", "/runs/x/initial_hf")
    with pytest.raises(ValueError, match=r"engine e0: EngineSpec takes absolute paths .*'model_path': 'runs/x/hf'"):
        EngineSpec("e0", "reference", "runs/x/hf", "/logs", RolloutConfig(), seed=1)


class _Ranks:
    """Stands in for the trainer ranks' RankWorkerGroup: records each method called on them with its arguments."""

    world_size = 1

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[object, ...]]] = []

    def call(self, method, *args, **kwargs) -> list[int]:
        self.calls.append((method.__name__, args))
        return [0]


def test_checkpoint_folders_reach_the_ranks_absolute(driver_dir: Path) -> None:
    ranks = _Ranks()
    group = TrainerGroup(ranks)  # type: ignore[arg-type]
    staging = Path("runs/x/checkpoints/step_00000002.tmp")
    group.save_checkpoint(staging)
    group.export_hf(staging / "hf")
    group.load_checkpoint(staging)
    assert ranks.calls[1:] == [
        (TrainerWorker.save_checkpoint.__name__, (str(driver_dir / staging),)),
        (TrainerWorker.export_hf.__name__, (str(driver_dir / staging / "hf"),)),
        (TrainerWorker.load_checkpoint.__name__, (str(driver_dir / staging),)),
    ]
