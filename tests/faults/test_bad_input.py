"""Bad input as a new user would bring it: each case is refused before any expensive work, with a message that
names the field or file (and row, tensor or engine), the offending value and the fix.

Four kinds: recipes (``load_recipe``: what ``validate`` and ``train`` run first), data
(``prepare_data``: what ``prepare`` and ``train`` run before Ray starts), Hugging Face model
directories (``load_recipe`` reads the safetensors headers of ``model.path``; resume compares the
checkpoint's model) and engines (the HTTP client against a canned server). Every file is built
tiny in ``tmp_path``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file, save_file

from megatron_rl.checkpoint.layout import HF_METADATA_DIR
from megatron_rl.checkpoint.run_checkpoint import check_same_model
from megatron_rl.config import RecipeError, load_recipe
from megatron_rl.config.loading import apply_overrides, read_recipe_tree, validate_recipe_tree
from megatron_rl.data import save_synthetic_tokenizer
from megatron_rl.data.preparation import prepare_data
from megatron_rl.engines import (
    EngineError,
    EngineRequestError,
    EngineResponseError,
    EngineUnavailableError,
    GenerateRequest,
    HttpEngine,
    SamplingParams,
)
from megatron_rl.models.safetensors_reader import CheckpointTensorError, SafetensorsCheckpoint
from megatron_rl.parallel.local_launch import free_port
from tests.faults.canned_engine import canned_engine, json_answer, sample
from tests.tiny_checkpoints import save_tiny_moe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
TINY = RECIPES / "tiny_moe_cpu_dapo.yaml"


def assert_says(message: str, *fragments: str) -> None:
    """Every fragment (field, file, value, fix) is in the message."""
    missing = [fragment for fragment in fragments if fragment not in message]
    assert not missing, f"{missing} not in: {message}"


def recipe_problems(*overrides: str, recipe: Path = TINY) -> str:
    """The problems ``load_recipe`` (validate, train) reports, one per line."""
    with pytest.raises(RecipeError) as info:
        load_recipe(recipe, overrides)
    return "\n".join(info.value.problems)


# --- recipes ---------------------------------------------------------------------------------------------------


def test_recipe_unknown_field_suggests_the_close_key() -> None:
    assert_says(
        recipe_problems("algorithm.clip_hgh=0.3"), "algorithm.clip_hgh: unknown key", "did you mean 'clip_high'"
    )


def test_recipe_unknown_section_suggests_the_close_section() -> None:
    assert_says(recipe_problems("trainer.lr=1"), "trainer: unknown key", "did you mean 'train'")


def test_recipe_wrong_type_names_field_and_value() -> None:
    assert_says(recipe_problems("train.prompts_per_step=many"), "train.prompts_per_step:", "'many'", "integer")


def test_recipe_numeric_string_is_not_taken_for_a_number() -> None:
    assert_says(recipe_problems("train.steps='5'"), "train.steps:", "'5'", "integer")


def test_recipe_value_out_of_range_says_what_is_allowed() -> None:
    assert_says(recipe_problems("rollout.top_p=1.5"), "rollout.top_p:", "less than or equal to 1", "1.5")


def test_recipe_new_reward_timeout_must_be_positive() -> None:
    assert_says(recipe_problems("data.reward_timeout_s=0"), "data.reward_timeout_s:", "greater than 0", "got 0")


def test_recipe_override_without_equals_shows_the_form() -> None:
    with pytest.raises(RecipeError) as info:
        apply_overrides({}, ["train.lr"])
    assert_says(str(info.value), "command line", "'train.lr'", "section.field=value")


def test_recipe_override_into_a_value_names_the_value() -> None:
    with pytest.raises(RecipeError) as info:
        apply_overrides({"train": {"lr": 1.0}}, ["train.lr.x=1"])
    assert_says(str(info.value), "train.lr.x: train.lr is a value, not a section")


def test_recipe_tensor_parallel_larger_than_the_kv_heads_names_the_fix() -> None:
    overrides = ("parallel.tp=4", "parallel.sequence_parallel=true", "parallel.ep=1", "cluster.cpu_trainer_ranks=4")
    assert_says(
        recipe_problems(*overrides), "parallel.tp: 4 does not divide the model's 2 key/value heads", "use a tp that"
    )


def test_recipe_world_size_the_parallel_sizes_do_not_factor() -> None:
    assert_says(recipe_problems("cluster.cpu_trainer_ranks=3"), "parallel.ep", "3")


def test_recipe_invalid_yaml_names_the_file(tmp_path: Path) -> None:
    recipe = tmp_path / "broken.yaml"
    recipe.write_text("train:\n  steps: [1, 2\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(recipe)
    assert_says(str(info.value), str(recipe), "invalid YAML", "line")


def test_recipe_base_cycle_shows_the_chain(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(tmp_path / "a.yaml")
    assert_says(str(info.value), "cycle", "a.yaml -> ", "b.yaml -> ")


def test_recipe_missing_required_field_is_named() -> None:
    tree = read_recipe_tree(TINY)
    del tree["train"]["steps"]
    with pytest.raises(RecipeError) as info:
        validate_recipe_tree(tree, "tiny")
    assert info.value.problems == ["train.steps: required, not set"]


def test_recipe_file_that_does_not_exist_is_named(tmp_path: Path) -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe(tmp_path / "nope.yaml")
    assert_says(str(info.value), "nope.yaml", "no such recipe file")


def test_recipe_resume_from_a_checkpoint_that_does_not_exist(tmp_path: Path) -> None:
    assert_says(
        recipe_problems(f"checkpoint.resume={tmp_path / 'gone'}"), "checkpoint.resume:", "gone", "neither 'auto'"
    )


# --- data -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_synthetic_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def verl_row(prompt: Any, answer: Any = "4") -> dict[str, Any]:
    return {"data_source": "unit", "prompt": prompt, "reward_model": {"ground_truth": answer}}


def write_rows(path: Path, rows: list[dict[str, Any]], schema: pa.Schema | None = None) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def data_error(train_file: Path, tokenizer_dir: Path, tmp_path: Path, *overrides: str) -> str:
    """The message of ``prepare_data`` on a recipe whose training data is ``train_file``."""
    cfg, _ = load_recipe(
        TINY,
        [
            "data.synthetic=null",
            f"data.train_files=[{train_file}]",
            "validation.interval=0",
            f"model.tokenizer={tokenizer_dir}",
            *overrides,
        ],
    )
    assert cfg.model.random_init is not None, "the tiny recipe builds its model from model.random_init"
    with pytest.raises(ValueError) as info:
        prepare_data(
            cfg.data,
            tokenizer_path=cfg.model.tokenizer,
            model_vocab_size=cfg.model.random_init["vocab_size"],
            max_prompt_length=cfg.rollout.max_prompt_length,
            work_dir=tmp_path / "work",
        )
    return str(info.value)


def test_data_missing_prompt_column_names_the_file_and_its_columns(tokenizer_dir: Path, tmp_path: Path) -> None:
    path = write_rows(tmp_path / "q.parquet", [{"question": "succ 1", "reward_model": {"ground_truth": "2"}}])
    message = data_error(path, tokenizer_dir, tmp_path)
    assert_says(message, "data.train_files:", str(path), "no column 'prompt'", "'question'")


def test_data_missing_answer_field_names_the_key_and_struct(tokenizer_dir: Path, tmp_path: Path) -> None:
    path = write_rows(tmp_path / "a.parquet", [{"prompt": "succ 1", "reward_model": {"answer": "2"}}])
    message = data_error(path, tokenizer_dir, tmp_path)
    assert_says(message, str(path), "key 'reward_model.ground_truth'", "has no field 'ground_truth'")


def test_data_empty_prompt_string_names_file_and_row(tokenizer_dir: Path, tmp_path: Path) -> None:
    path = write_rows(tmp_path / "e.parquet", [verl_row("succ 1"), verl_row("succ 2"), verl_row("")])
    message = data_error(path, tokenizer_dir, tmp_path)
    assert_says(message, "data.train_files:", f"{path} row 2 key 'prompt'", "the prompt is empty", "remove the row")


def test_data_whitespace_chat_prompt_is_empty_too(tokenizer_dir: Path, tmp_path: Path) -> None:
    rows = [verl_row([{"role": "user", "content": "succ 1"}]), verl_row([{"role": "user", "content": "  \n"}])]
    message = data_error(write_rows(tmp_path / "w.parquet", rows), tokenizer_dir, tmp_path)
    assert_says(message, "row 1 key 'prompt'", "the prompt is empty (whitespace only)", "fill it in")


def test_data_prompt_that_is_not_utf8_names_file_row_and_byte(tokenizer_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "latin1.parquet"
    pq.write_table(
        pa.Table.from_pylist([verl_row("succ 1"), verl_row("succ QZ")]),
        path,
        use_dictionary=False,
        compression="none",
        write_statistics=False,
    )
    path.write_bytes(path.read_bytes().replace(b"succ QZ", "succ \xe9Z".encode("latin-1")))  # a Latin-1 byte
    message = data_error(path, tokenizer_dir, tmp_path)
    assert_says(message, f"{path} row 1 key 'prompt'", "not valid UTF-8", "at byte 5", "re-encode")


def test_data_binary_prompt_column_asks_for_strings(tokenizer_dir: Path, tmp_path: Path) -> None:
    schema = pa.schema([("prompt", pa.binary()), ("reward_model", pa.struct([("ground_truth", pa.string())]))])
    path = write_rows(tmp_path / "b.parquet", [verl_row(b"succ 1")], schema)
    message = data_error(path, tokenizer_dir, tmp_path)
    assert_says(message, f"{path} row 0 key 'prompt'", "binary data, not text", "as UTF-8 strings")


def test_data_every_prompt_longer_than_max_prompt_length_names_the_field_and_the_size_needed(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    path = write_rows(tmp_path / "long.parquet", [verl_row("max 1 2"), verl_row("max 1 2 3 4")])
    message = data_error(path, tokenizer_dir, tmp_path, "rollout.max_prompt_length=2")
    assert_says(message, str(path), "2 longer than max_prompt_length=2", "rollout.max_prompt_length", "at least 6")


def test_data_file_without_rows(tokenizer_dir: Path, tmp_path: Path) -> None:
    schema = pa.schema([("prompt", pa.string()), ("reward_model", pa.struct([("ground_truth", pa.string())]))])
    path = write_rows(tmp_path / "empty.parquet", [], schema)
    assert_says(data_error(path, tokenizer_dir, tmp_path), "data.train_files:", str(path), "has no rows")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_data_corrupt_parquet_file_is_named(damage: str, tokenizer_dir: Path, tmp_path: Path) -> None:
    path = write_rows(tmp_path / f"{damage}.parquet", [verl_row("succ 1")] * 8)
    data = path.read_bytes()
    path.write_bytes(b"not parquet at all" if damage == "garbage" else data[: len(data) // 2])
    message = data_error(path, tokenizer_dir, tmp_path)
    assert_says(message, "data.train_files:", str(path), "not a readable parquet file", "Parquet magic bytes")


def test_data_null_ground_truth_names_the_row(tokenizer_dir: Path, tmp_path: Path) -> None:
    path = write_rows(tmp_path / "n.parquet", [verl_row("succ 1"), verl_row("succ 2", None)])
    message = data_error(path, tokenizer_dir, tmp_path)
    assert_says(message, f"{path} row 1 key 'reward_model.ground_truth'", "missing (null)", "fill it in")


def test_data_file_that_does_not_exist_is_refused_by_validate(tokenizer_dir: Path, tmp_path: Path) -> None:
    absent = tmp_path / "absent.parquet"
    message = recipe_problems(
        "data.synthetic=null",
        f"data.train_files=[{absent}]",
        "validation.interval=0",
        f"model.tokenizer={tokenizer_dir}",
    )
    assert message == f"data.train_files: no such file: '{absent}': needed before training"


def test_data_tokenizer_larger_than_the_model_vocabulary(tokenizer_dir: Path, tmp_path: Path) -> None:
    path = write_rows(tmp_path / "ok.parquet", [verl_row("succ 1")])
    message = data_error(path, tokenizer_dir, tmp_path, "model.random_init.vocab_size=16")
    assert_says(message, "model vocab_size", "18 tokens", "16", "use the checkpoint's own tokenizer")


# --- Hugging Face model directories ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE checkpoint (4 layers, 4 experts, layer 1 dense) written by transformers."""
    return save_tiny_moe(tmp_path_factory.mktemp("hf") / "moe")


@pytest.fixture
def model_dir(pristine: Path, tmp_path: Path) -> Path:
    """A copy of :func:`pristine` to damage."""
    target = tmp_path / "model"
    target.mkdir()
    for file in pristine.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    return target


def model_problems(model_dir: Path) -> str:
    return recipe_problems("model.random_init=null", f"model.path={model_dir}")


def edit_tensors(model_dir: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    tensors = load_file(model_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})


def edit_config(model_dir: Path, **changes: Any) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | changes))


def test_model_the_pristine_checkpoint_validates(model_dir: Path) -> None:
    load_recipe(TINY, ["model.random_init=null", f"model.path={model_dir}"])


def test_model_missing_tensor_is_named(model_dir: Path) -> None:
    edit_tensors(model_dir, lambda t: t.pop("model.layers.2.mlp.experts.3.up_proj.weight"))
    assert_says(
        model_problems(model_dir),
        f"model.path: {model_dir}: 1 of the",
        "are missing: model.layers.2.mlp.experts.3.up_proj.weight",
        "download or export the checkpoint again",
    )


def test_model_tensor_of_the_wrong_shape_is_named_with_both_shapes(model_dir: Path) -> None:
    edit_tensors(model_dir, lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:16]}))
    assert_says(
        model_problems(model_dir),
        "model.path:",
        "1 tensor(s) of another shape than config.json implies: model.norm.weight [16] in model.safetensors "
        "(config.json implies [32])",
        "use the config.json that came with them",
    )


def test_model_config_json_of_another_size_than_the_weights(model_dir: Path) -> None:
    edit_config(model_dir, hidden_size=64)
    message = model_problems(model_dir)
    assert_says(message, "model.path:", "69 tensor(s) of another shape than config.json implies", "and 64 more")
    assert_says(message, "model.embed_tokens.weight [100, 32] in model.safetensors (config.json implies [100, 64])")


def test_model_unsupported_architecture_names_the_config_file(model_dir: Path) -> None:
    edit_config(model_dir, architectures=["LlamaForCausalLM"])
    assert_says(
        model_problems(model_dir),
        f"model.path: {model_dir / 'config.json'}: architectures=['LlamaForCausalLM']",
        "supported are ['Qwen3ForCausalLM', 'Qwen3MoeForCausalLM']",
    )


def test_model_config_json_that_is_not_json(model_dir: Path) -> None:
    (model_dir / "config.json").write_text('{"architectures": ["Qwen3MoeForCausalLM"],')
    assert_says(model_problems(model_dir), f"model.path: {model_dir / 'config.json'} is not valid JSON", "again")


def test_model_truncated_safetensors_file_is_named_with_its_sizes(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    assert_says(
        model_problems(model_dir),
        f"model.path: {weights}: truncated",
        f"declares {len(data)} bytes but the file has {len(data) - 1000}",
        "download or export the checkpoint again",
    )


def test_model_file_that_is_not_safetensors(model_dir: Path) -> None:
    (model_dir / "model.safetensors").write_text("<html>403 Forbidden</html>")
    assert_says(model_problems(model_dir), f"{model_dir / 'model.safetensors'}: not a safetensors file", "again")


def test_model_index_naming_an_absent_shard(model_dir: Path) -> None:
    tensors = load_file(model_dir / "model.safetensors")
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:10]}, model_dir / "model-00001-of-00002.safetensors")
    (model_dir / "model.safetensors").unlink()
    weight_map = {
        n: "model-00001-of-00002.safetensors" if i < 10 else "model-00002-of-00002.safetensors"
        for i, n in enumerate(names)
    }
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert_says(
        model_problems(model_dir),
        "model.safetensors.index.json names model-00002-of-00002.safetensors, which is not in",
        "download or export the checkpoint again",
    )


def test_model_loader_names_a_truncated_file_too(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointTensorError) as info:
        SafetensorsCheckpoint(model_dir)
    assert_says(str(info.value), str(weights), "not a readable safetensors file", "again")


def test_model_resume_checkpoint_of_another_model_names_the_fields(tmp_path: Path) -> None:
    cfg, _ = load_recipe(TINY)
    metadata = tmp_path / "step_000002" / HF_METADATA_DIR
    metadata.mkdir(parents=True)
    assert cfg.model.random_init is not None, "the tiny recipe builds its model from model.random_init"
    (metadata / "config.json").write_text(json.dumps(dict(cfg.model.random_init) | {"num_hidden_layers": 4}))
    with pytest.raises(ValueError) as info:
        check_same_model(cfg, metadata.parent)
    assert_says(str(info.value), "checkpoint.resume:", "num_layers: 4 saved, 2 in the recipe", "checkpoint.resume=none")


# --- engines -----------------------------------------------------------------------------------------------------


def generate(engine: HttpEngine) -> None:
    engine.generate(GenerateRequest([1, 2], SamplingParams(max_new_tokens=2), rid="g7"), timeout_s=10)


def engine_error(answer: Callable[[str, Any], tuple[int, str, bytes]], kind: type[EngineError]) -> str:
    with canned_engine(answer) as engine, pytest.raises(kind) as info:
        generate(engine)
    return str(info.value)


def test_engine_unreachable_names_engine_url_and_what_to_check() -> None:
    engine = HttpEngine("e0", "127.0.0.1", port := free_port())
    with pytest.raises(EngineUnavailableError) as info:
        generate(engine)
    assert_says(str(info.value), f"engine e0: /generate failed at http://127.0.0.1:{port}/generate", "listens at")


def test_engine_http_error_status_carries_status_body_and_url() -> None:
    answer = lambda path, body: (500, "text/plain", b"scheduler crashed")  # noqa: E731
    with canned_engine(answer) as engine, pytest.raises(EngineRequestError) as info:
        generate(engine)
    assert info.value.status == 500 and info.value.body == "scheduler crashed"
    assert_says(str(info.value), "engine canned: /generate answered HTTP 500 at http://127.0.0.1:", "scheduler crashed")


def test_engine_http_404_says_the_endpoint_is_not_there() -> None:
    message = engine_error(lambda path, body: (404, "application/json", b'{"detail":"Not Found"}'), EngineRequestError)
    assert_says(message, "/generate answered HTTP 404", "Not Found")


def test_engine_malformed_json_names_the_engine_and_the_fix() -> None:
    message = engine_error(lambda path, body: (200, "application/json", b'{"text": "hi", '), EngineResponseError)
    assert_says(
        message, "engine canned: /generate answered malformed JSON at http://", "SGLang 0.5.23", "rollout.engine"
    )


def test_engine_answer_without_meta_info_names_the_missing_field() -> None:
    message = engine_error(lambda path, body: json_answer({"text": "", "output_ids": [3]}), EngineResponseError)
    assert_says(message, "engine canned: /generate", "no field 'meta_info'", '"output_ids": [3]', "SGLang 0.5.23")


def test_engine_answer_with_fewer_log_probs_than_tokens() -> None:
    broken = sample([3, 4], "g7")
    broken["meta_info"]["output_token_logprobs"] = broken["meta_info"]["output_token_logprobs"][:1]
    message = engine_error(lambda path, body: json_answer(broken), EngineResponseError)
    assert_says(message, "engine canned: /generate", "1 log-probs for 2 output tokens", "SGLang 0.5.23")


def test_engine_empty_answer_is_refused() -> None:
    message = engine_error(lambda path, body: (200, "application/json", b""), EngineResponseError)
    assert_says(message, "engine canned: /generate", "does not allow", "null")
