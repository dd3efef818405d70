"""Preflight step ``inputs``: the model files, the tokenizer, the prompt files and the reward, as the run reads them.

Model files are checked from the safetensors headers alone (no tensor is read): the index and the shards agree
name for name, and the names and shapes cover what the architecture of config.json needs. The data goes through
the run's own preparation (:func:`~megatron_rl.data.preparation.prepare_data`); a synthetic task writes its files
under ``runs/<name>/preflight/``, never into the run's own folders. A few rows are scored by the recipe's reward,
each with its ground truth written as a correct response.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from safetensors import SafetensorError, safe_open

from megatron_rl.config.hf_config import INDEX_FILE, SINGLE_FILE, QwenArchitecture
from megatron_rl.config.hf_weights import weight_problems
from megatron_rl.config.model_source import ModelSourceError, read_architecture
from megatron_rl.config.schema import DataConfig, RunConfig, ValidationConfig
from megatron_rl.data.math_reward import math_01, math_dapo, math_equiv
from megatron_rl.data.preparation import PreparedData, prepare_recipe_data
from megatron_rl.data.rewards import RewardFn
from megatron_rl.data.synthetic_task import synthetic_exact, synthetic_lookup_answer
from megatron_rl.data.synthetic_tokenizer import ASSISTANT_TOKEN, CALL_TOKEN, EOS_TOKEN, TOOL_TOKEN
from megatron_rl.named_functions import qualified_name
from megatron_rl.preflight.report import StepFailure, StepOutcome
from megatron_rl.wire.fp8_blocks import SCALE_SUFFIX, is_quantized

SAMPLE_ROWS = 3
"""Training rows scored by the reward."""
ANSWER_LINE = "Answer: {}"
"""A correct response to the math rewards: DAPO's rule reads the last ``Answer:`` line, the lenient checker too
when there is no box; also what a reward this module does not know is given."""
CORRECT_RESPONSES: dict[Callable[..., Any], str] = {
    math_dapo: ANSWER_LINE,
    math_equiv: ANSWER_LINE,
    math_01: ANSWER_LINE,
    synthetic_exact: "{}" + EOS_TOKEN,
    synthetic_lookup_answer: CALL_TOKEN + TOOL_TOKEN + ASSISTANT_TOKEN + "{}" + EOS_TOKEN,
}
"""Per shipped reward, the template (``{}``: the ground truth) of a response it judges correct."""
_REFETCH = "download or export the checkpoint again"
_FIELD = re.compile(r"^((?:model|data|rollout)\.\w+(?:\.\w+)?):")


def preflight_dir(cfg: RunConfig) -> Path:
    """``runs/<name>/preflight``: where preflight writes (its report, a synthetic task's files)."""
    return Path(cfg.run_dir) / "preflight"


def checkpoint_names(model_dir: Path, field: str) -> tuple[int, dict[str, Path]]:
    """(weight files, name -> file) of the checkpoint in ``model_dir``, whose index (if sharded) names files that
    exist, each holding in its header exactly the names the index maps to it.

    Only headers are read. StepFailure naming the file, with the fix ``field`` (the recipe field that names the
    directory), when the directory has no weights, a file is absent or not safetensors, or index and headers differ.
    """
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (ValueError, TypeError, KeyError) as error:
            raise StepFailure(f"{index} is not a safetensors index ({error!r})", f"{field}: {_REFETCH}") from error
    elif (model_dir / SINGLE_FILE).is_file():
        weight_map = {name: SINGLE_FILE for name in _header_names(model_dir / SINGLE_FILE, field)}
    else:
        raise StepFailure(f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}", f"{field}: {_REFETCH}")
    files = sorted(set(weight_map.values()))
    for file in files:
        mapped = {name for name, mapped_file in weight_map.items() if mapped_file == file}
        if not (model_dir / file).is_file():
            raise StepFailure(
                f"{index} maps {len(mapped)} tensors to {file}, which is not in {model_dir}",
                f"{field}: {_REFETCH} (the shard is missing)",
            )
        held = _header_names(model_dir / file, field)
        if held != mapped:
            absent, unlisted = sorted(mapped - held), sorted(held - mapped)
            raise StepFailure(
                f"{model_dir / file} does not hold what {index.name} maps to it: {len(absent)} named there are "
                f"absent ({', '.join(absent[:3])}), {len(unlisted)} held are not named ({', '.join(unlisted[:3])})",
                f"{field}: {_REFETCH} (the index and the shard come from different exports)",
            )
    return len(files), {name: model_dir / file for name, file in weight_map.items()}


def _header_names(path: Path, field: str) -> set[str]:
    """The tensor names of a safetensors file's header (no tensor data is read)."""
    try:
        with safe_open(path, framework="numpy") as handle:
            return set(handle.keys())
    except (SafetensorError, OSError) as error:
        raise StepFailure(f"{path} is not a readable safetensors file ({error})", f"{field}: {_REFETCH}") from error


def _covers(model_dir: Path, arch: QwenArchitecture, field: str) -> None:
    """StepFailure unless the checkpoint holds every tensor ``arch`` needs, in its shape, in files of full length."""
    problems = weight_problems(model_dir, arch)
    if problems:
        raise StepFailure("; ".join(problems), f"{field}: {_REFETCH}, or give the config.json that came with it")


def check_model_files(cfg: RunConfig, arch: QwenArchitecture) -> tuple[list[str], dict[str, Any]]:
    """Lines and figures of the model's weights (see :func:`checkpoint_names`) and, with FP8 rollouts, of the FP8
    checkpoint the engines start from when it is already converted; StepFailure naming the file and the field."""
    if cfg.model.path is None:
        lines = [f"model.random_init: the weights are initialised at random (seed {cfg.train.seed}); no files"]
        figures: dict[str, Any] = {}
    else:
        model_dir = Path(cfg.model.path)
        shards, names = checkpoint_names(model_dir, "model.path")
        _covers(model_dir, arch, "model.path")
        lines = [f"{model_dir}: {shards} weight files, {len(names)} tensors, every one {arch.architecture} needs"]
        figures = {"model_shards": shards, "model_tensors": len(names)}
    if cfg.rollout_fp8_dir is not None:
        lines.append(_check_fp8_checkpoint(cfg, arch))
    return lines, figures


def _check_fp8_checkpoint(cfg: RunConfig, arch: QwenArchitecture) -> str:
    """The line of the FP8 checkpoint of FP8 rollouts: converted at run start, or present with every quantised
    projection's ``weight_scale_inv``."""
    fp8_dir = Path(str(cfg.rollout_fp8_dir))
    if not (fp8_dir / "config.json").is_file():
        return f"FP8 rollouts: {fp8_dir} is not there yet; the run converts the model into it at start"
    field = (
        "rollout.fp8_checkpoint"
        if cfg.rollout.fp8_checkpoint
        else f"rollout.fp8_checkpoint (or delete {fp8_dir}: the run converts the model into it again)"
    )
    _, names = checkpoint_names(fp8_dir, field)
    _covers(fp8_dir, arch, field)
    unscaled = sorted(name for name in names if is_quantized(name) and name + SCALE_SUFFIX not in names)
    if unscaled:
        raise StepFailure(
            f"{fp8_dir}: {len(unscaled)} FP8 projections have no weight{SCALE_SUFFIX} "
            f"({', '.join(f'{name} in {names[name].name}' for name in unscaled[:3])})",
            f"{field}: an FP8 checkpoint holds a weight{SCALE_SUFFIX} per quantised projection "
            "(megatron-rl convert hf-to-fp8 writes one)",
        )
    quantized = sum(map(is_quantized, names))
    return f"FP8 rollouts: {fp8_dir} holds {quantized} FP8 projections, each with its weight{SCALE_SUFFIX}"


def missing_column(schema: pa.Schema, key: str) -> str | None:
    """What ``schema`` lacks for ``key`` (a column name, or a dotted path into struct columns; an exact column name
    wins, as the dataset reader has it), None when nothing."""
    if key in schema.names:
        return None
    head, *fields = key.split(".")
    if head not in schema.names:
        return f"no column {head!r}"
    kind, walked = schema.field(head).type, head
    for name in fields:
        if not pa.types.is_struct(kind) or kind.get_field_index(name) < 0:
            return f"column {walked!r} ({kind}) has no field {name!r}"
        kind, walked = kind.field(name).type, f"{walked}.{name}"
    return None


def check_parquet_columns(data: DataConfig, validation: ValidationConfig) -> dict[str, int]:
    """Rows of each parquet file the recipe names, once each has the prompt and answer columns the recipe names.

    Reads the files' schemas and footers only. StepFailure naming the file and the column, with the fix the recipe
    field (``data.answer_key``, ``data.prompt_key``, ``data.train_files``, ``data.val_files`` or
    ``validation.sets.<name>.files``)."""
    rows = {}
    named = [("data.train_files", data.train_files), ("data.val_files", data.val_files)]
    named += [(f"validation.sets.{name}.files", each.files) for name, each in validation.sets.items()]
    for files_field, files in named:
        for file in files:
            path = Path(file)
            try:
                schema, rows[file] = pq.read_schema(path), pq.read_metadata(path).num_rows
            except (pa.ArrowException, OSError) as error:
                raise StepFailure(
                    f"{path} is not a readable parquet file: {error}",
                    f"{files_field}: name a parquet file that is there (e.g. written by pandas.DataFrame.to_parquet)",
                ) from error
            for key_field, key, holds in (
                ("data.prompt_key", data.prompt_key, "the prompts"),
                ("data.answer_key", data.answer_key, "the reference answers"),
            ):
                missing = missing_column(schema, key)
                if missing is not None:
                    raise StepFailure(
                        f"{path}: {missing} for {key_field}={key!r}; its columns are {schema.names}",
                        f"{key_field}: name the column of {path.name} that holds {holds} (a dotted path walks into "
                        f"a struct column), or write the file with it ({files_field})",
                    )
    return rows


def prepare(cfg: RunConfig, arch: QwenArchitecture) -> PreparedData:
    """The run's data preparation, a synthetic task's files written under :func:`preflight_dir`; StepFailure
    with the recipe field the problem names (the tokenizer's when none)."""
    try:
        return prepare_recipe_data(cfg, model_vocab_size=arch.vocab_size, work_dir=preflight_dir(cfg) / "data")
    except (ValueError, OSError) as error:  # AutoTokenizer raises OSError for a directory without a tokenizer
        raise _failure(error, "model.tokenizer") from error


def _failure(error: Exception, field: str) -> StepFailure:
    """``error`` as a StepFailure whose fix is the recipe field its message starts with, else ``field``."""
    named = _FIELD.match(str(error))
    return StepFailure(
        str(error), f"{named[1] if named else field}: change it (or the file it names) as the cause says"
    )


def correct_response(reward_fn: RewardFn, ground_truth: str) -> str:
    """A response ``reward_fn`` should judge correct for ``ground_truth`` (:data:`CORRECT_RESPONSES`; an
    ``Answer:`` line for a reward not shipped here)."""
    return CORRECT_RESPONSES.get(reward_fn, ANSWER_LINE).format(ground_truth)


def score_sample(prepared: PreparedData, reward: str, rows: int = SAMPLE_ROWS) -> list[tuple[str, float, bool]]:
    """(response, score, correct) of the first ``rows`` training rows, each row's ground truth written as a correct
    response (:func:`correct_response`) and scored by the reward; StepFailure naming ``data.reward`` when it raises.
    Empty for a judge (``prepared.reward_fn`` None): its engines start with a run."""
    if prepared.reward_fn is None:
        return []
    reward_fn = prepared.reward_fn
    scored = []
    for item in (prepared.train[index] for index in range(min(rows, len(prepared.train)))):
        response = correct_response(reward_fn, item.ground_truth)
        try:
            output = reward_fn(response, item.ground_truth, item.extra_info)
        except Exception as error:  # any error of user code is the finding
            raise StepFailure(
                f"data.reward {reward} ({qualified_name(reward_fn)}) raised {type(error).__name__}: {error} "
                f"on training row {item.index}, response {response!r}, ground truth {item.ground_truth!r}",
                "data.reward: fix the reward function (a response's reward must not raise), or name another",
            ) from error
        scored.append((response, output.score, output.correct))
    return scored


def check_inputs(cfg: RunConfig) -> StepOutcome:
    """The step: model files (or a random init), FP8 scales of a converted FP8 checkpoint, the tokenizer, the
    parquet columns, the data as the run prepares it, and :data:`SAMPLE_ROWS` rows scored by the reward.

    Raises StepFailure at the first problem, naming the file and the recipe field to change. Figures: weight files
    and tensors, tokenizer size, rows per split, the sample's rewards.
    """
    try:
        arch = read_architecture(cfg.model.path, cfg.model.random_init)
    except ModelSourceError as error:
        raise _failure(error, "model.path") from error
    lines, figures = check_model_files(cfg, arch)
    rows = check_parquet_columns(cfg.data, cfg.validation)
    lines += [
        f"{file}: {count} rows, columns {cfg.data.prompt_key!r} and {cfg.data.answer_key!r}"
        for file, count in rows.items()
    ]
    prepared = prepare(cfg, arch)
    lines.append(
        f"tokenizer {prepared.tokenizer_dir}: {len(prepared.tokenizer)} tokens, within the model's {arch.vocab_size}"
    )
    for split, dataset in (
        ("train", prepared.train),
        *((f"val_{name}", data) for name, data in prepared.val_sets.items()),
    ):
        if dataset is not None:
            figures[f"{split}_rows"] = len(dataset) + dataset.num_filtered
            lines.append(
                f"{split}: {len(dataset)} prompts kept, {dataset.num_filtered} longer than "
                f"rollout.max_prompt_length={cfg.rollout.max_prompt_length} tokens filtered out"
            )
    scored = score_sample(prepared, cfg.data.reward)
    lines += [
        f"reward {cfg.data.reward}: {response!r} scores {score:+g} (correct: {ok})" for response, score, ok in scored
    ]
    figures |= {"tokenizer_tokens": len(prepared.tokenizer), "sample_rewards": [score for _, score, _ in scored]}
    return StepOutcome(lines=lines, figures=figures)
