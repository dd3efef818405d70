"""What the driver checks before resuming: the checkpoint holds the recipe's model, and the adapter its ``lora:``
section trains (or none)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from megatron_rl.checkpoint import TrainerState
from megatron_rl.checkpoint.commit import commit_checkpoint, staging_dir
from megatron_rl.checkpoint.layout import HF_METADATA_DIR
from megatron_rl.checkpoint.run_checkpoint import check_same_adapter, check_same_model
from megatron_rl.checkpoint.trainer_state import save_trainer_state
from megatron_rl.cli import main
from megatron_rl.config import load_recipe
from megatron_rl.orchestration.driver import finished_run_notice

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny_moe_cpu_dapo.yaml"


def _checkpoint_of(tmp_path: Path, **changes: object) -> Path:
    cfg = load_recipe(RECIPE)[0]
    metadata = tmp_path / "step_000002" / HF_METADATA_DIR
    metadata.mkdir(parents=True)
    assert cfg.model.random_init is not None, "the tiny recipe builds its model from model.random_init"
    config = dict(cfg.model.random_init) | {"eos_token_id": 2, "torch_dtype": "float32"} | changes
    (metadata / "config.json").write_text(json.dumps(config))
    return metadata.parent


def test_a_checkpoint_of_the_recipes_model_passes(tmp_path: Path) -> None:
    check_same_model(load_recipe(RECIPE)[0], _checkpoint_of(tmp_path))


def test_a_checkpoint_of_another_model_is_refused_naming_the_fields(tmp_path: Path) -> None:
    checkpoint = _checkpoint_of(tmp_path, hidden_size=128, num_experts=8)
    with pytest.raises(ValueError, match="checkpoint.resume") as error:
        check_same_model(load_recipe(RECIPE)[0], checkpoint)
    assert "hidden_size: 128 saved, 64 in the recipe" in str(error.value)
    assert "num_experts: 8 saved, 4 in the recipe" in str(error.value)


def _state(lora: dict[str, object] | None) -> TrainerState:
    return TrainerState(step=2, sampler={}, weight_version=2, lora=lora)


def test_a_checkpoint_resumes_only_into_the_adapter_it_holds(tmp_path: Path) -> None:
    plain = load_recipe(RECIPE)[0]
    adapted = load_recipe(RECIPE, ["lora.rank=4", "lora.target_modules=[v_proj, q_proj]"])[0]
    assert adapted.lora is not None
    saved = adapted.lora.model_dump(mode="json")
    check_same_adapter(plain, _state(None), tmp_path)
    check_same_adapter(adapted, _state(saved), tmp_path)
    # the adapter's function: target order, the engines' slot count and (zero) dropout are not part of it
    check_same_adapter(
        adapted, _state(saved | {"target_modules": ["q_proj", "v_proj"], "max_loras_per_batch": 2}), tmp_path
    )

    with pytest.raises(
        ValueError, match=r"checkpoint.resume: .* holds another adapter \(rank: 8 saved, 4 in the recipe"
    ):
        check_same_adapter(adapted, _state(saved | {"rank": 8}), tmp_path)
    with pytest.raises(ValueError, match="holds a LoRA adapter .* and the recipe has no lora: section"):
        check_same_adapter(plain, _state(saved), tmp_path)
    with pytest.raises(ValueError, match="trained every weight, the recipe's lora: section trains an adapter"):
        check_same_adapter(adapted, _state(None), tmp_path)


def _finished_run(tmp_path: Path, step: int) -> list[str]:
    """Overrides of the tiny recipe whose checkpoint directory holds a committed checkpoint at ``step``."""
    root = tmp_path / "checkpoints"
    staged = staging_dir(root, step)  # created empty
    save_trainer_state(staged, TrainerState(step=step, sampler={}, weight_version=step))
    metadata = staged / HF_METADATA_DIR
    metadata.mkdir()
    cfg = load_recipe(RECIPE)[0]
    assert cfg.model.random_init is not None, "the tiny recipe builds its model from model.random_init"
    (metadata / "config.json").write_text(json.dumps(dict(cfg.model.random_init) | {"torch_dtype": "float32"}))
    commit_checkpoint(root, step)
    return [f"checkpoint.dir={root}", f"logging.dir={tmp_path / 'logs'}"]


def test_a_finished_run_says_so_before_starting_anything(tmp_path: Path, capsys) -> None:
    overrides = _finished_run(tmp_path, 150)
    started = time.perf_counter()
    assert main(["train", str(RECIPE), *overrides]) == 0
    assert time.perf_counter() - started < 5  # no Ray, no ranks, no engines
    out = capsys.readouterr().out
    assert "holds step 150 of train.steps=150; nothing to do" in out
    assert "raise train.steps (e.g. train.steps=300)" in out and "checkpoint.resume=none" in out


def test_an_unfinished_run_gets_no_notice(tmp_path: Path) -> None:
    cfg = load_recipe(RECIPE, _finished_run(tmp_path, 50))[0]
    assert finished_run_notice(cfg, Path(cfg.checkpoint_dir), 50) is None
