"""The smoke run's overrides keep what a recipe is about and shrink the rest (megatron_rl.config.smoke)."""

from __future__ import annotations

from pathlib import Path

from megatron_rl.config import load_recipe, read_architecture
from megatron_rl.config.smoke import smoke_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _smoke(recipe: str, overrides: list[str]):
    cfg, _ = load_recipe(RECIPES / recipe, overrides, require_files=False)
    changes = smoke_recipe(cfg, read_architecture(cfg.model.path, cfg.model.random_init, cfg.model.config_fallback))
    smoke, _ = load_recipe(
        RECIPES / recipe, [*overrides, *(change.override for change in changes)], require_files=False
    )
    return cfg, smoke, {change.field for change in changes}


def test_the_30b_dapo_recipe_keeps_its_algorithm_and_kinds_of_parallelism(qwen3_30b_overrides: list[str]) -> None:
    cfg, smoke, changed = _smoke("qwen3_30b_a3b_dapo.yaml", qwen3_30b_overrides)
    assert smoke.algorithm.model_dump(exclude={"overlong", "dynamic_sampling"}) == cfg.algorithm.model_dump(
        exclude={"overlong", "dynamic_sampling"}
    )
    assert smoke.algorithm.routing_replay and smoke.train.recompute == "full" and smoke.algorithm.overlong.enable
    assert smoke.algorithm.dynamic_sampling.metric == "acc" and smoke.weight_sync == cfg.weight_sync
    par = smoke.parallel
    assert (par.tp, par.sequence_parallel, par.ep, par.pp, smoke.cluster.cpu_trainer_ranks) == (2, True, 2, 1, 4)
    model = smoke.model.random_init
    assert model["architectures"] == ["Qwen3MoeForCausalLM"] and model["num_experts_per_tok"] == 2
    assert (smoke.rollout.engine, smoke.train.precision, smoke.cluster.gpus_per_node) == ("reference", "fp32", 0)
    assert smoke.data.train_files == ["runs/smoke-qwen3-30b-a3b-dapo/generated/successor_train.parquet"]
    assert smoke.data.apply_chat_template == cfg.data.apply_chat_template and smoke.data.synthetic is None
    assert smoke.model.tokenizer == "runs/smoke-qwen3-30b-a3b-dapo/generated/tokenizer"
    assert "algorithm.clip_high" not in changed
    assert smoke.train.mini_batches_per_step == 2 and smoke.train.steps == 2


def test_pipeline_and_virtual_stages_are_kept() -> None:
    _, smoke, _ = _smoke(
        "tiny_moe_cpu_grpo.yaml",
        [
            "parallel.pp=2",
            "parallel.vpp=2",
            "parallel.ep=1",
            "cluster.cpu_trainer_ranks=2",
            "model.random_init.num_hidden_layers=4",
        ],
    )
    assert (smoke.parallel.pp, smoke.parallel.vpp, smoke.model.random_init["num_hidden_layers"]) == (2, 2, 4)


def test_a_remote_reward_gives_way_to_the_generated_tasks_own_where_the_data_is_generated(
    qwen3_30b_overrides: list[str],
) -> None:
    remote = ["data.reward=remote", "data.remote_reward.url=http://rm-host:8000/score"]
    _, smoke, _ = _smoke("qwen3_30b_a3b_dapo.yaml", [*qwen3_30b_overrides, *remote])
    assert (smoke.data.reward, smoke.data.remote_reward) == ("synthetic_successor", None)
    _, kept, _ = _smoke("tiny_moe_cpu_dapo.yaml", remote)  # its own data: the server scores the smoke run too
    assert kept.data.reward == "remote" and kept.data.remote_reward is not None


def test_a_judge_gives_way_to_the_generated_tasks_reward_and_a_synthetic_recipe_keeps_it(
    qwen3_30b_overrides: list[str], tmp_path: Path
) -> None:
    judge = ["data.reward=judge", f"judge.model={tmp_path}", "judge.num_engines=8", "judge.engine=sglang"]
    _, smoke, changed = _smoke("qwen3_30b_a3b_dapo.yaml", [*qwen3_30b_overrides, *judge])
    assert (smoke.data.reward, smoke.judge, smoke.job_nodes) == ("synthetic_successor", None, 1)
    assert "judge" in changed
    _, kept, _ = _smoke("tiny_moe_cpu_dapo.yaml", judge[:2])  # its own data: the judge scores the smoke run too
    assert kept.data.reward == "judge" and kept.judge is not None and kept.judge.model == str(tmp_path)


def test_a_recipe_with_its_data_here_keeps_it() -> None:
    cfg, smoke, changed = _smoke("tiny_moe_cpu_dapo.yaml", [])
    assert smoke.data.synthetic == cfg.data.synthetic and "data.synthetic" not in changed


def test_context_parallelism_is_kept_beside_tensor_and_expert_parallelism(qwen3_30b_overrides: list[str]) -> None:
    cfg, smoke, _ = _smoke("qwen3_30b_a3b_dapo_long.yaml", qwen3_30b_overrides)
    assert cfg.parallel.cp == 4
    par = smoke.parallel
    assert (par.tp, par.cp, par.ep, par.pp, smoke.cluster.cpu_trainer_ranks) == (2, 2, 2, 1, 4)


def test_an_uneven_pipeline_stays_uneven() -> None:
    _, smoke, _ = _smoke(
        "tiny_moe_cpu_grpo.yaml",
        [
            "parallel.pp=4",
            "parallel.first_stage_layers=2",
            "parallel.last_stage_layers=2",
            "parallel.ep=1",
            "cluster.cpu_trainer_ranks=4",
            "model.random_init.num_hidden_layers=8",
        ],
    )
    assert (smoke.parallel.pp, smoke.parallel.first_stage_layers, smoke.parallel.last_stage_layers) == (2, 1, None)
    assert smoke.model.random_init["num_hidden_layers"] == 3
