"""What the driver checks before resuming: the checkpoint holds the recipe's model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.checkpoint.layout import HF_METADATA_DIR
from megatron_rl.checkpoint.run_checkpoint import check_same_model
from megatron_rl.config import load_recipe

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny_moe_cpu_dapo.yaml"


def _checkpoint_of(tmp_path: Path, **changes: object) -> Path:
    cfg = load_recipe(RECIPE)[0]
    metadata = tmp_path / "step_000002" / HF_METADATA_DIR
    metadata.mkdir(parents=True)
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
