"""What ``validate`` says about SGLang recipes: the CPU path's limits and models SGLang 0.5.23 cannot serve."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.config import RecipeError, load_recipe

SGLANG_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny_moe_cpu_dapo_sglang.yaml"


def _problems(*overrides: str) -> list[str]:
    with pytest.raises(RecipeError) as info:
        load_recipe(SGLANG_RECIPE, overrides)
    return info.value.problems


@pytest.fixture(autouse=True)
def sglang_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """These checks do not depend on this machine's SGLang installation (one test removes it)."""
    monkeypatch.setattr("megatron_rl.config.checks.sglang_python", lambda: "/opt/sglang/bin/python")


def test_the_shipped_sglang_recipe_validates_on_cpu() -> None:
    cfg, _ = load_recipe(SGLANG_RECIPE)
    assert cfg.rollout.engine == "sglang" and cfg.cluster.gpus_per_node == 0
    assert cfg.rollout.dtype == "float32" and cfg.rollout.max_total_tokens == 8192


def test_sglang_on_cpu_without_an_installation_names_the_setup_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("megatron_rl.config.checks.sglang_python", lambda: None)
    assert any(p.startswith("rollout.engine: no SGLang installation found") and "setup.sh --sglang" in p
               for p in _problems())  # fmt: skip


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("rollout.max_total_tokens=null", "rollout.max_total_tokens"),
        ("algorithm.routing_replay=true", "algorithm.routing_replay"),
        ("rollout.quantization=fp8", "rollout.quantization"),
    ],
)
def test_what_sglang_cannot_do_on_cpu_is_refused_by_field(override: str, field: str) -> None:
    assert any(problem.startswith(f"{field}: ") for problem in _problems(override))


def test_a_qwen3_moe_with_dense_layers_is_refused_for_sglang() -> None:
    problems = _problems("model.random_init.mlp_only_layers=[1]")
    assert any(p.startswith("rollout.engine: the model's layers [1] are dense") for p in problems)
    cfg, _ = load_recipe(SGLANG_RECIPE, ["model.random_init.mlp_only_layers=[1]", "rollout.engine=reference"])
    assert cfg.rollout.engine == "reference"
