"""Recipe loading, overrides and cross-field validation (the `megatron-rl validate` behaviour)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import psutil
import pytest
import yaml

from megatron_rl.cli import main
from megatron_rl.config import RecipeError, load_recipe, recipe_to_yaml
from megatron_rl.config.loading import apply_overrides, parse_yaml, read_recipe_tree, validate_recipe_tree
from tests.hf_configs import QWEN3_30B_A3B_CONFIG_FILE

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
TINY = RECIPES / "tiny_moe_cpu_dapo.yaml"


def _problems(recipe: Path, *overrides: str) -> list[str]:
    with pytest.raises(RecipeError) as info:
        load_recipe(recipe, overrides)
    return info.value.problems


@pytest.mark.parametrize(
    "recipe", ["tiny_moe_cpu_dapo", "tiny_moe_cpu_drgrpo", "tiny_moe_cpu_grpo", "tiny_moe_cpu_dapo_async"]
)
def test_shipped_tiny_recipes_validate(recipe: str) -> None:
    cfg, _ = load_recipe(RECIPES / f"{recipe}.yaml")
    assert cfg.cluster.gpus_per_node == 0 and cfg.rollout.engine == "reference"


@pytest.mark.parametrize(
    "recipe",
    [
        "qwen3_30b_a3b_dapo",
        "qwen3_30b_a3b_drgrpo",
        "qwen3_30b_a3b_dapo_async",
        "qwen3_30b_a3b_drgrpo_async",
        "qwen3_30b_a3b_dapo_fp8",
    ],
)
def test_shipped_qwen3_30b_recipes_validate(recipe: str, qwen3_30b_overrides: list[str]) -> None:
    cfg, warnings = load_recipe(RECIPES / f"{recipe}.yaml", qwen3_30b_overrides, require_files=False)
    assert cfg.parallel.ep == 8 and cfg.cluster.nodes * cfg.cluster.gpus_per_node == 32
    assert {w.level for w in warnings} == {"needed"}  # the weights; nothing else to warn about


def test_qwen3_30b_recipe_rejects_tp8_against_four_kv_heads(qwen3_30b_overrides: list[str]) -> None:
    problems = _problems(RECIPES / "qwen3_30b_a3b_dapo.yaml", *qwen3_30b_overrides, "parallel.tp=8")
    assert "parallel.tp: 8 does not divide the model's 4 key/value heads; use a tp that divides 4" in problems


def test_dapo_recipe_values_match_the_paper() -> None:
    cfg, _ = load_recipe(TINY)
    algo = cfg.algorithm
    assert (algo.clip_low, algo.clip_high) == (0.2, 0.28)
    assert algo.loss_agg_mode == "token-mean" and not algo.use_kl_loss and algo.dynamic_sampling.enable


def test_base_recipe_values_are_inherited_and_overridden() -> None:
    tree = read_recipe_tree(TINY)
    assert tree["name"] == "tiny-moe-cpu-dapo"
    assert tree["model"]["random_init"]["num_experts"] == 4
    assert "base" not in tree


def test_override_parses_scientific_notation_as_float() -> None:
    cfg, _ = load_recipe(TINY, ["train.lr=1e-6", "validation.interval=5"])
    assert cfg.train.lr == pytest.approx(1e-6) and cfg.validation.interval == 5


def test_override_sets_list_and_creates_missing_section() -> None:
    tree = apply_overrides({"a": {"b": 1}}, ["a.c=[x, y]", "d.e=true"])
    assert tree == {"a": {"b": 1, "c": ["x", "y"]}, "d": {"e": True}}


def test_override_does_not_mutate_the_input_tree() -> None:
    tree = {"a": {"b": 1}}
    apply_overrides(tree, ["a.b=2"])
    assert tree == {"a": {"b": 1}}


@pytest.mark.parametrize("override", ["train.lr", "=3", "train..lr=3"])
def test_malformed_override_is_rejected(override: str) -> None:
    with pytest.raises(RecipeError, match="section.field=value"):
        apply_overrides({}, [override])


def test_override_into_a_value_is_rejected() -> None:
    with pytest.raises(RecipeError, match="train.lr is a value, not a section"):
        apply_overrides({"train": {"lr": 1.0}}, ["train.lr.x=1"])


def test_yaml_reads_exponent_without_dot_as_float() -> None:
    assert parse_yaml("a: 1e-6\nb: 2E5\nc: 1.5\nd: 10", "t") == {"a": 1e-6, "b": 2e5, "c": 1.5, "d": 10}


def test_unknown_key_names_the_field_and_suggests_the_close_match() -> None:
    (problem,) = _problems(TINY, "algorithm.clip_hgh=0.3")
    assert problem.startswith("algorithm.clip_hgh: unknown key; did you mean 'clip_high'?")


def test_unknown_top_level_section_is_rejected() -> None:
    (problem,) = _problems(TINY, "trainer.lr=1")
    assert problem.startswith("trainer: unknown key; did you mean 'train'?")


def test_wrong_type_names_the_field_and_the_value() -> None:
    (problem,) = _problems(TINY, "train.prompts_per_step=many")
    assert problem.startswith("train.prompts_per_step:") and "'many'" in problem


def test_numeric_string_is_not_coerced() -> None:
    (problem,) = _problems(TINY, "train.steps='5'")
    assert problem.startswith("train.steps:") and "'5'" in problem


def test_out_of_range_value_says_what_is_allowed() -> None:
    (problem,) = _problems(TINY, "rollout.top_p=1.5")
    assert problem.startswith("rollout.top_p: Input should be less than or equal to 1")


def test_top_k_zero_is_rejected_with_the_fix() -> None:
    (problem,) = _problems(TINY, "rollout.top_k=0")
    assert "use -1 to disable top-k" in problem


def test_missing_required_field_is_named() -> None:
    tree = read_recipe_tree(TINY)
    del tree["train"]["steps"]
    with pytest.raises(RecipeError) as info:
        validate_recipe_tree(tree, "t")
    assert info.value.problems == ["train.steps: required, not set"]


def test_indivisible_experts_by_ep() -> None:
    problems = _problems(TINY, "parallel.ep=3", "cluster.cpu_trainer_ranks=3")
    assert "parallel.ep: 3 does not divide the model's 4 experts" in problems


def test_indivisible_heads_by_tp() -> None:
    problems = _problems(
        TINY, "parallel.tp=3", "parallel.ep=1", "parallel.sequence_parallel=true", "cluster.cpu_trainer_ranks=3"
    )
    assert "parallel.tp: 3 does not divide the model's 4 attention heads" in problems


def test_indivisible_layers_by_pp_times_vpp() -> None:
    problems = _problems(TINY, "parallel.pp=2", "parallel.vpp=2", "parallel.ep=1")
    assert "parallel.pp: pp (2) x vpp (2) = 4 does not divide the model's 2 layers" in problems


def test_vpp_without_pipeline_is_rejected() -> None:
    assert "parallel.vpp: virtual pipeline stages need pp > 1; unset vpp or raise pp" in _problems(
        TINY, "parallel.vpp=2"
    )


def test_world_size_must_factor_into_model_parallel_sizes() -> None:
    problems = _problems(TINY, "cluster.cpu_trainer_ranks=3", "parallel.pp=2", "parallel.ep=1")
    assert "parallel: tp (1) x pp (2) x cp (1) = 2 does not divide the 3 trainer ranks" in problems


def test_expert_layout_must_factor_the_world_size() -> None:
    problems = _problems(TINY, "cluster.cpu_trainer_ranks=3")
    assert "parallel.ep: etp (1) x ep (2) x pp (1) = 2 does not divide the 3 trainer ranks" in problems


def test_moe_with_tensor_parallel_requires_sequence_parallel() -> None:
    problems = _problems(TINY, "parallel.tp=2", "parallel.ep=1")
    assert any(p.startswith("parallel.sequence_parallel:") for p in problems)


def test_batch_must_split_over_data_parallel_ranks() -> None:
    problems = _problems(TINY, "train.prompts_per_step=3", "rollout.n_samples_per_prompt=3")
    assert any(p.startswith("train.prompts_per_step: each mini-batch has 9 responses") for p in problems)


def test_async_needs_disaggregated_engines_and_the_importance_correction() -> None:
    problems = _problems(TINY, "train.max_staleness=1")
    assert any(p.startswith("train.max_staleness: 1 with colocated engines") for p in problems)
    assert any(p.startswith("algorithm.tis_cap: None with train.max_staleness=1") for p in problems)
    cfg, _ = load_recipe(TINY, ["train.max_staleness=1", "rollout.placement=disaggregated", "algorithm.tis_cap=2.0"])
    assert cfg.train.max_staleness == 1


def test_mini_batches_must_divide_prompts() -> None:
    problems = _problems(TINY, "train.mini_batches_per_step=3")
    assert "train.mini_batches_per_step: 3 does not divide train.prompts_per_step (8)" in problems


def test_sequence_lengths_must_fit_model_positions() -> None:
    problems = _problems(TINY, "rollout.max_response_length=60")
    assert any(
        p.startswith("rollout.max_response_length: max_prompt_length + max_response_length = 76") for p in problems
    )


def test_drgrpo_with_std_normalisation_is_an_error() -> None:
    problems = _problems(RECIPES / "tiny_moe_cpu_drgrpo.yaml", "algorithm.norm_adv_by_std=true")
    assert problems == [
        "algorithm.norm_adv_by_std: Dr.GRPO drops the std normalisation of advantages; fix it or set algorithm.preset: custom"
    ]


def test_custom_preset_allows_ablations() -> None:
    cfg, _ = load_recipe(
        RECIPES / "tiny_moe_cpu_drgrpo.yaml", ["algorithm.norm_adv_by_std=true", "algorithm.preset=custom"]
    )
    assert cfg.algorithm.norm_adv_by_std


def test_dapo_without_clip_higher_is_an_error() -> None:
    assert any(
        p.startswith("algorithm.clip_high: DAPO's Clip-Higher") for p in _problems(TINY, "algorithm.clip_high=0.2")
    )


def test_sglang_on_cpu_without_a_cache_size_is_rejected() -> None:
    problems = _problems(TINY, "rollout.engine=sglang")
    assert any(p.startswith("rollout.max_total_tokens: SGLang on CPU sizes its KV cache") for p in problems)


def test_fp8_needs_a_recipe_and_gpus() -> None:
    problems = _problems(TINY, "train.precision=fp8")
    assert any(p.startswith("train.precision: fp8 needs GPUs") for p in problems)
    assert any(p.startswith("train.fp8_recipe: precision fp8 needs a recipe") for p in problems)


def test_routing_replay_needs_an_moe_model(tmp_path: Path) -> None:
    overrides = ["model.random_init.architectures=[Qwen3ForCausalLM]", "parallel.ep=1", "algorithm.routing_replay=true"]
    assert "algorithm.routing_replay: Qwen3ForCausalLM has no experts to replay" in _problems(TINY, *overrides)


def test_unsupported_architecture_is_named() -> None:
    (problem,) = _problems(TINY, "model.random_init.architectures=[LlamaForCausalLM]")
    assert "LlamaForCausalLM" in problem and "Qwen3MoeForCausalLM" in problem


def test_model_path_without_config_json(tmp_path: Path) -> None:
    (problem,) = _problems(TINY, "model.random_init=null", f"model.path={tmp_path}")
    assert problem.startswith("model.path: no config.json")


def test_missing_data_file_is_needed_before_training(qwen3_30b_overrides: list[str]) -> None:
    overrides = [*qwen3_30b_overrides, "data.val_files=[nowhere.parquet]"]
    _, warnings = load_recipe(RECIPES / "qwen3_30b_a3b_dapo.yaml", overrides, require_files=False)
    assert "data.val_files: no such file: 'nowhere.parquet': needed before training" in map(str, warnings)
    problems = _problems(RECIPES / "qwen3_30b_a3b_dapo.yaml", *overrides)
    assert "data.val_files: no such file: 'nowhere.parquet': needed before training" in problems


def test_wandb_sink_without_a_project_is_rejected() -> None:
    assert _problems(TINY, "logging.sinks=[jsonl,wandb]") == [
        "logging.wandb_project: required when logging.sinks includes 'wandb'"
    ]


def test_kl_coefficient_without_kl_loss_is_a_warning() -> None:
    _, warnings = load_recipe(TINY, ["algorithm.kl_coef=0.1"])
    assert [str(w) for w in warnings] == ["algorithm.kl_coef: ignored because use_kl_loss is false"]


def test_base_cycle_is_reported(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(RecipeError, match="cycle"):
        read_recipe_tree(tmp_path / "a.yaml")


def test_resolved_recipe_round_trips(tmp_path: Path) -> None:
    cfg, _ = load_recipe(TINY, ["train.lr=3e-4"])
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(recipe_to_yaml(cfg))
    again, _ = load_recipe(resolved)
    assert again == cfg


def test_validate_command_prints_resolved_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(TINY), "train.steps=7"]) == 0
    out = capsys.readouterr().out
    assert "# trainer: 2 ranks (CPU) = tp 1 x pp 1 x cp 1 x dp 2" in out
    assert "steps: 7" in out


def test_validate_command_lists_errors_and_exits_non_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(TINY), "parallel.ep=3", "algorithm.clip_hgh=1"]) == 1
    err = capsys.readouterr().err
    assert "algorithm.clip_hgh: unknown key" in err


def test_hf_field_megatron_cannot_honour_is_rejected_at_validation() -> None:
    (problem,) = _problems(TINY, "model.random_init.rope_scaling={rope_type: yarn, factor: 4.0}")
    assert problem.startswith("model.random_init: rope_scaling=") and "only plain RoPE" in problem


def test_sampling_temperature_other_than_one_trains_without_warning() -> None:
    cfg, warnings = load_recipe(TINY, ["rollout.temperature=0.7"])
    assert cfg.rollout.temperature == 0.7
    assert not [w for w in warnings if w.field == "rollout.temperature"], warnings


@pytest.mark.parametrize("value, shown", [("0", "0.0"), ("-0.5", "-0.5"), (".inf", "inf")])
def test_training_temperature_not_positive_is_rejected_with_the_fix(value: str, shown: str) -> None:
    (problem,) = _problems(TINY, f"rollout.temperature={value}")
    assert problem.startswith(f"rollout.temperature: {shown}: training needs sampled rollouts")
    assert "must be a finite number > 0" in problem and "set rollout.temperature to e.g. 1.0" in problem


def test_validation_sets_may_sample_greedily_or_truncated() -> None:
    cfg, _ = load_recipe(TINY, ["validation.sets.aime.top_p=0.7", "validation.sets.aime.temperature=1.0"])
    assert cfg.validation.sets["greedy"].temperature == 0.0 and cfg.validation.sets["aime"].top_p == 0.7
    assert list(cfg.validation.sets) == ["greedy", "sampled", "aime"]  # recipe order, what the console and eval keep


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("train.val_interval=5", "validation.interval"),
        ("train.val_samples_per_prompt=8", "validation.sets.<name>.n"),
        ("train.val_temperature=1.0", "validation.sets.<name>.temperature"),
    ],
)
def test_the_old_validation_fields_name_where_they_moved(old: str, new: str) -> None:
    (problem,) = _problems(TINY, old)
    assert problem.startswith(f"{old.split('=')[0]}: moved to {new} (named validation sets")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("validation.sets.sampled.ks=[1,16]", "ks [1, 16] has a k above n=8"),
        ("validation.sets.bad.name.n=1", "unknown key"),
        ("validation.sets={}", "at least 1 item"),
        ("validation.sets.greedy.top_k=0", "top_k 0 would sample nothing"),
        ("validation.sets.greedy.files=[v.parquet]", "data.synthetic generates its own validation split"),
    ],
)
def test_bad_validation_sets_are_refused_naming_the_field(override: str, message: str) -> None:
    problems = _problems(TINY, override)
    assert any(message in problem and problem.startswith("validation.sets") for problem in problems), problems


def test_a_set_with_a_bad_name_is_refused() -> None:
    (problem,) = _problems(TINY, "validation.sets={'a b': {n: 1}}")
    assert "set name 'a b' must be letters, digits" in problem


@pytest.mark.parametrize(
    ("off", "without_files"),
    [
        ([], {"greedy", "sampled"}),
        (["validation.interval=0"], set()),
        (["validation.sets.greedy.interval=0"], {"sampled"}),
        (["validation.sets.sampled.interval=0"], {"greedy"}),
    ],
)
def test_a_file_recipe_without_validation_files_needs_them_only_for_the_sets_training_runs(
    off: list[str], without_files: set[str]
) -> None:
    problems = _problems(TINY, "data.synthetic=null", "data.train_files=[t.parquet]", "model.tokenizer=tok", *off)
    flagged = {
        p.split(".")[2] for p in problems if p.startswith("validation.sets.") and "and so is data.val_files" in p
    }
    assert flagged == without_files


QWEN3_30B = RECIPES / "qwen3_30b_a3b_dapo.yaml"


def test_engine_data_parallelism_is_refused_because_sglang_asserts_dp_1_for_weight_updates(qwen3_30b_overrides):
    problems = _problems(QWEN3_30B, *qwen3_30b_overrides, "rollout.dp=2")
    (problem,) = [p for p in problems if p.startswith("rollout.dp:")]
    assert "2: SGLang 0.5.23 asserts dp_size == 1 for every weight update" in problem and "set rollout.dp=1" in problem
    assert any(p.startswith("rollout.dp:") for p in _problems(TINY, "rollout.dp=2"))


def test_an_engine_ep_that_does_not_divide_the_experts_is_refused(qwen3_30b_overrides, tmp_path):
    config = json.loads(QWEN3_30B_A3B_CONFIG_FILE.read_text()) | {"num_experts": 60}
    (tmp_path / "config.json").write_text(json.dumps(config))
    problems = _problems(
        QWEN3_30B,
        *qwen3_30b_overrides,
        f"model.config_fallback={tmp_path / 'config.json'}",
        "rollout.ep=8",
        "rollout.tp=8",
    )
    (problem,) = [p for p in problems if p.startswith("rollout.ep:")]
    assert "engine ep (8) must divide the model's 60 experts" in problem


@pytest.mark.parametrize("transport", ["auto", "tensor"])
def test_colocated_tensor_sync_across_nodes_validates_at_the_30b_layout(qwen3_30b_overrides, transport):
    problems = _problems(QWEN3_30B, *qwen3_30b_overrides, f"weight_sync.transport={transport}")
    assert not [p for p in problems if p.startswith(("weight_sync.transport:", "parallel."))]


@pytest.mark.parametrize(
    ("overrides", "field", "quoted"),
    [
        (["parallel.pp=2", "parallel.ep=4"], "parallel.pp", "2 pipeline stages on 4 nodes"),
        (["parallel.ep=16", "parallel.tp=2", "rollout.ep=2"], "parallel.ep", "= 16 does not divide the 8 ranks"),
        (["parallel.tp=16"], "parallel.tp", "16 does not divide the 8 ranks of a node"),
    ],
)
def test_colocated_tensor_sync_refuses_groups_that_leave_a_node(qwen3_30b_overrides, overrides, field, quoted):
    problems = _problems(QWEN3_30B, *qwen3_30b_overrides, "weight_sync.transport=tensor", *overrides)
    (problem,) = [p for p in problems if p.startswith(f"{field}:") and "weight_sync.transport=tensor" in p]
    assert quoted in problem and "weight_sync.transport=disk" in problem


def test_colocated_ipc_on_one_node_and_disaggregated_broadcast_across_nodes_validate(qwen3_30b_overrides):
    load_recipe(QWEN3_30B, [*qwen3_30b_overrides, "cluster.nodes=1", "weight_sync.transport=auto"], require_files=False)
    load_recipe(
        QWEN3_30B,
        [*qwen3_30b_overrides, "rollout.placement=disaggregated", "rollout.num_gpus=16", "weight_sync.transport=auto"],
        require_files=False,
    )


@pytest.mark.parametrize("recipe", ["qwen3_30b_gpus", "tiny_cpu"])
def test_the_tensor_transport_to_disaggregated_engines_is_refused(qwen3_30b_overrides, recipe):
    """CUDA IPC handles open only on the trainer's GPUs, CPU shared memory only on its node: neither reaches engines
    on devices of their own."""
    disaggregated = ["rollout.placement=disaggregated", "weight_sync.transport=tensor"]
    if recipe == "tiny_cpu":
        problems = _problems(TINY, *disaggregated, "cluster.cpu_engines=2")
    else:
        problems = _problems(QWEN3_30B, *qwen3_30b_overrides, *disaggregated, "rollout.num_gpus=16")
    (problem,) = [p for p in problems if p.startswith("weight_sync.transport:")]
    assert problem.startswith("weight_sync.transport: 'tensor' with rollout.placement=disaggregated")
    assert "CUDA IPC handles" in problem and "shared memory on CPU, which does not cross nodes" in problem
    assert problem.endswith(
        "use weight_sync.transport=auto (distributed when disaggregated), distributed or disk, or "
        "rollout.placement=colocated"
    )


def test_colocated_broadcast_is_refused_on_gpus(qwen3_30b_overrides):
    problems = _problems(QWEN3_30B, *qwen3_30b_overrides, "cluster.nodes=1", "weight_sync.transport=distributed")
    assert any(p.startswith("weight_sync.transport:") and "NCCL refuses" in p for p in problems)


def test_mxfp8_is_refused_on_hopper_and_accepted_on_blackwell(qwen3_30b_overrides):
    fp8 = [*qwen3_30b_overrides, "train.precision=fp8", "train.fp8_recipe=mxfp8"]
    (problem,) = [p for p in _problems(QWEN3_30B, *fp8) if p.startswith("train.fp8_recipe:")]
    assert "compute capability >= 10.0" in problem and "'hopper' (H100/H200, 9.0)" in problem
    assert "train.fp8_recipe=blockwise" in problem
    cfg, _ = load_recipe(QWEN3_30B, [*fp8, "cluster.gpu_arch=blackwell"], require_files=False)
    assert cfg.train.fp8_recipe == "mxfp8"
    load_recipe(
        QWEN3_30B, [*qwen3_30b_overrides, "train.precision=fp8", "train.fp8_recipe=blockwise"], require_files=False
    )


def _fresh_clone(tmp_path: Path, monkeypatch) -> list[str]:
    """A copy of recipes/ as the working directory, with nothing downloaded; the recipe paths in it."""
    shutil.copytree(RECIPES, tmp_path / "recipes")
    monkeypatch.chdir(tmp_path)
    return sorted(str(path.relative_to(tmp_path)) for path in (tmp_path / "recipes").glob("*.yaml"))


def test_every_shipped_recipe_validates_and_plans_without_downloads(tmp_path: Path, monkeypatch, capsys) -> None:
    recipes = _fresh_clone(tmp_path, monkeypatch)
    assert len(recipes) >= 5
    for recipe in recipes:
        assert main(["validate", recipe]) == 0, capsys.readouterr().err
        assert main(["plan", recipe]) == 0, capsys.readouterr().out
    capsys.readouterr()


def test_strict_validate_names_every_absent_file(tmp_path: Path, monkeypatch, capsys) -> None:
    _fresh_clone(tmp_path, monkeypatch)
    recipe = "recipes/qwen3_30b_a3b_dapo.yaml"
    assert main(["validate", recipe]) == 0
    needed = [
        "data.train_files: no such file: 'data/dapo-math-17k.parquet': needed before training",
        "data.val_files: no such file: 'data/aime-2024.parquet': needed before training",
        "model.path: no config.json in 'checkpoints/Qwen3-30B-A3B': needed before training",
        "model.path: no weights (model.safetensors or model.safetensors.index.json) in "
        "'checkpoints/Qwen3-30B-A3B': needed before training",
    ]
    if "ib0" not in psutil.net_if_addrs():  # the recipe's cluster.network_interface, absent on most CI machines
        needed.append("cluster.network_interface: this machine has no interface 'ib0' (it has ")
    err = capsys.readouterr().err
    assert all(f"warning: {line}" in err for line in needed), err
    assert main(["validate", "--strict", recipe]) == 1
    err = capsys.readouterr().err
    assert f"{len(needed)} problem(s)" in err and all(f"  - {line}" in err for line in needed), err


def test_train_refuses_absent_files_before_starting_anything(tmp_path: Path, monkeypatch, capsys) -> None:
    _fresh_clone(tmp_path, monkeypatch)
    assert main(["train", "recipes/qwen3_30b_a3b_dapo.yaml"]) == 1
    assert "no weights" in capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["parallel.sequence_parallel=true"], "parallel.sequence_parallel"),  # tp 1
        (["parallel.tp=2", "parallel.ep=1"], "parallel.sequence_parallel"),  # MoE needs it too
        (["algorithm.loss_norm_constant=12"], "algorithm.loss_norm_constant"),  # token-mean
        (["rollout.top_p=0.9"], "rollout.top_p"),
        (["rollout.top_k=5"], "rollout.top_k"),
        (["algorithm.dynamic_sampling.metric=score"], "algorithm.dynamic_sampling.metric"),  # preset dapo
        (["algorithm.dynamic_sampling.gen_batch_prompts=4"], "algorithm.dynamic_sampling.gen_batch_prompts"),
    ],
)
def test_options_the_trainer_would_ignore_are_refused(overrides: list[str], field: str) -> None:
    assert field in [problem.split(":", 1)[0] for problem in _problems(TINY, *overrides)]


def test_score_filtering_is_allowed_outside_the_dapo_preset() -> None:
    cfg, _ = load_recipe(TINY, ["algorithm.preset=custom", "algorithm.dynamic_sampling.metric=score"])
    assert cfg.algorithm.dynamic_sampling.metric == "score"


def test_dapo_recipe_warms_up_over_the_papers_20_rollout_steps(qwen3_30b_overrides: list[str]) -> None:
    cfg, _ = load_recipe(RECIPES / "qwen3_30b_a3b_dapo.yaml", qwen3_30b_overrides, require_files=False)
    assert cfg.train.warmup_steps == 20 and cfg.algorithm.dynamic_sampling.metric == "acc"


def test_over_sampling_is_a_recipe_field() -> None:
    cfg, _ = load_recipe(TINY, ["algorithm.dynamic_sampling.gen_batch_prompts=24"])
    assert cfg.algorithm.dynamic_sampling.gen_batch_prompts == 24


def test_deterministic_inference_is_refused_on_cpu_sglang_and_a_no_op_warning_on_the_reference_engine():
    problems = _problems(RECIPES / "tiny_moe_cpu_dapo_sglang.yaml", "rollout.deterministic_inference=true")
    assert any(
        p.startswith("rollout.deterministic_inference: SGLang 0.5.23 refuses --enable-deterministic-inference")
        for p in problems
    ), problems
    _, warnings = load_recipe(TINY, ["rollout.deterministic_inference=true"])
    assert [w.field for w in warnings] == ["rollout.deterministic_inference"]
    assert "always deterministic" in warnings[0].message


def test_fp8_rollouts_are_refused_on_blackwell_where_sglang_rereads_the_scales_as_ue8m0(qwen3_30b_overrides):
    problems = _problems(RECIPES / "qwen3_30b_a3b_dapo_fp8.yaml", *qwen3_30b_overrides, "cluster.gpu_arch=blackwell")
    (problem,) = [p for p in problems if p.startswith("rollout.quantization:")]
    assert "re-quantises them to UE8M0" in problem and "cluster.gpu_arch=hopper" in problem


@pytest.mark.parametrize("recipe", ["qwen3_30b_a3b_dapo", "qwen3_235b_a22b_dapo"])
def test_the_large_recipes_validate_aime_as_readme_shows_and_the_dapo_paper_reports(recipe: str) -> None:
    readme = (RECIPES.parent / "README.md").read_text()
    fragment = readme[readme.index("```yaml\nvalidation:") + len("```yaml\n") :]
    shown = yaml.safe_load(fragment[: fragment.index("```")])["validation"]
    cfg, _ = load_recipe(RECIPES / f"{recipe}.yaml", require_files=False)
    assert cfg.validation.model_dump(exclude_defaults=True, mode="json") == shown
    aime = cfg.validation.sets["aime24"]
    assert (aime.n, aime.temperature, aime.top_p) == (32, 1.0, 0.7)  # avg@32 at T 1.0, top_p 0.7


REMOTE = ["data.reward=remote", "data.remote_reward.url=http://rm-host:8000/score"]


def test_a_remote_reward_validates_with_a_url_and_default_settings_that_fit_the_reward_timeout() -> None:
    cfg, warnings = load_recipe(TINY, REMOTE)
    remote = cfg.data.remote_reward
    assert remote is not None and remote.url == "http://rm-host:8000/score" and warnings == []
    assert (remote.score_key, remote.correct_threshold, remote.retries) == ("score", 0.5, 2)


def test_a_remote_reward_without_a_url_is_refused_with_the_fix() -> None:
    assert _problems(TINY, "data.reward=remote") == [
        "data.remote_reward.url: required when data.reward is 'remote' (not set): give the reward server's URL, "
        "e.g. data.remote_reward.url=http://rm-host:8000/score"
    ]
    assert _problems(TINY, "data.reward=remote", "data.remote_reward.retries=1") == [
        "data.remote_reward.url: required, not set"
    ]


def test_a_reward_server_url_with_another_reward_is_refused_naming_both() -> None:
    assert _problems(TINY, "data.remote_reward.url=http://rm-host:8000/score") == [
        "data.remote_reward.url: 'http://rm-host:8000/score' is set but data.reward is 'synthetic_successor', which "
        "does not use it: set data.reward=remote to score through that server, or remove data.remote_reward"
    ]


@pytest.mark.parametrize("url", ["rm-host:8000/score", "ftp://rm-host/score", "http:///score", "http://rm:port/x"])
def test_a_reward_server_url_must_be_http_with_a_host(url: str) -> None:
    (problem,) = _problems(TINY, "data.reward=remote", f"data.remote_reward.url={url}")
    assert problem.startswith("data.remote_reward.url: ") and "is not an http:// or https:// URL with a host" in problem


def test_retries_that_cannot_fit_in_the_reward_timeout_are_refused_with_the_arithmetic() -> None:
    # 4 tries x 10 s + waits 0.5 + 1 + 2 = 43.5 s > 30 s: the worker would be killed before the last tries.
    overrides = [*REMOTE, "data.remote_reward.retries=3", "data.remote_reward.timeout_s=10.0"]
    assert _problems(TINY, *overrides) == [
        "data.remote_reward.retries: 3 retries do not fit in data.reward_timeout_s=30 s, after which the reward "
        "worker is killed: 4 tries of up to timeout_s=10 s and the waits between them take up to 43.5 s; lower "
        "data.remote_reward.retries or data.remote_reward.timeout_s, or raise data.reward_timeout_s to 44"
    ]
    cfg, _ = load_recipe(TINY, [*overrides, "data.reward_timeout_s=44.0"])
    assert cfg.data.remote_reward is not None and cfg.data.remote_reward.worst_case_s == 43.5


def test_validate_asks_the_reward_server_to_score_the_empty_response(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.remote_reward_server import RewardServer

    with RewardServer() as server:
        assert main(["validate", str(TINY), "data.reward=remote", f"data.remote_reward.url={server.url()}"]) == 0
    assert [r.body["response"] for r in server.received] == [""]
    capsys.readouterr()
    # Down, or unreachable from this machine: a warning (the job's nodes may reach it); --strict and train refuse.
    assert main(["validate", str(TINY), "data.reward=remote", f"data.remote_reward.url={server.url()}"]) == 0
    warned = capsys.readouterr().err
    assert (
        warned.startswith("warning: data.reward: ")
        and "connection refused" in warned.lower()
        and server.url() in warned
    )
    assert warned.rstrip().endswith("needed before training")
    strict = ["validate", str(TINY), "data.reward=remote", f"data.remote_reward.url={server.url()}", "--strict"]
    assert main(strict) == 1
    refused = capsys.readouterr().err
    assert (
        refused.startswith("error: data.reward: ")
        and "connection refused" in refused.lower()
        and server.url() in refused
    )
