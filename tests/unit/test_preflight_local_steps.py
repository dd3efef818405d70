"""The preflight steps that run on one machine: install, inputs, storage; each passes on the tiny recipe and fails,
with its cause and the recipe field to fix, on the fault planted for it."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.checkpoint.fp8_convert import convert_hf_to_fp8
from megatron_rl.config import RunConfig, load_recipe
from megatron_rl.config.hf_config import INDEX_FILE, SINGLE_FILE
from megatron_rl.config.sglang_env import SGLANG_PYTHON_ENV, sglang_python
from megatron_rl.data.rewards import RewardOutput
from megatron_rl.data.synthetic_tokenizer import save_synthetic_tokenizer
from megatron_rl.preflight import install
from megatron_rl.preflight.inputs import check_inputs
from megatron_rl.preflight.install import check_install, check_transformer_engine
from megatron_rl.preflight.report import StepFailure
from megatron_rl.preflight.storage import check_storage
from tests.tiny_checkpoints import save_tiny_moe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
TINY = RECIPES / "tiny_moe_cpu_dapo.yaml"


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run from ``tmp_path``, so that ``runs/<name>/`` lands there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _tiny(tmp_path: Path, *overrides: str) -> RunConfig:
    cfg, _ = load_recipe(TINY, [f"checkpoint.dir={tmp_path / 'ckpt'}", *overrides])
    return cfg


# --- install ---------------------------------------------------------------------------------------------------


def test_install_passes_on_the_tiny_recipe_with_the_locked_versions(in_tmp: Path) -> None:
    outcome = check_install(_tiny(in_tmp))
    assert outcome.figures["torch"] == torch.__version__
    assert outcome.figures["python"] == ".".join(map(str, sys.version_info[:3]))
    assert set(install.PINNED) == set(outcome.figures["packages"])
    assert any("as launch/requirements.lock pins" in line for line in outcome.lines)
    assert "transformer_engine" not in outcome.figures and "sglang" not in outcome.figures  # fp32, reference engine


def test_a_version_other_than_the_lock_fails_naming_the_package_both_versions_and_setup(
    in_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = install.installed_version
    monkeypatch.setattr(install, "installed_version", lambda p: "2.13.0" if p == "torch" else real(p))
    with pytest.raises(StepFailure) as failure:
        check_install(_tiny(in_tmp))
    assert "torch 2.13.0" in failure.value.cause and "requirements.lock pins torch==2.14.1" in failure.value.cause
    assert failure.value.fix.startswith("run ./launch/setup.sh (installs launch/requirements.lock)")


@pytest.mark.parametrize(
    "proc",
    [
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.129.03  Thu Oct 19 18:56:32 UTC 2023\n",
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  535.129.03  Release Build  (dvs-builder@U16)\n",
    ],
)
def test_the_driver_version_is_read_from_the_proprietary_and_the_open_module(tmp_path: Path, proc: str) -> None:
    (tmp_path / "version").write_text(proc + "GCC version:  gcc version 12.2.0\n")
    assert install.driver_version(tmp_path / "version") == "535.129.03"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_gpu_recipe_where_no_gpu_is_visible_fails_naming_gpus_per_node(in_tmp: Path) -> None:
    with pytest.raises(StepFailure) as failure:
        check_install(_tiny(in_tmp, "cluster.gpus_per_node=2"))
    assert "runs on 2 GPUs per node and this process sees 0" in failure.value.cause
    assert failure.value.fix.startswith("cluster.gpus_per_node")


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="Transformer Engine is here")
def test_fp8_training_without_transformer_engine_fails_naming_train_precision(in_tmp: Path) -> None:
    fp8 = _tiny(in_tmp, "cluster.gpus_per_node=2", "train.precision=fp8", "train.fp8_recipe=blockwise")
    with pytest.raises(StepFailure) as failure:
        check_transformer_engine(fp8.train)
    assert "train.precision is fp8 and Transformer Engine does not import" in failure.value.cause
    assert "ModuleNotFoundError" in failure.value.cause
    assert "./launch/setup.sh --gpu" in failure.value.fix and "train.precision=bf16" in failure.value.fix


@pytest.mark.skipif(sglang_python() is None, reason="no SGLang installation (./launch/setup.sh --sglang)")
def test_sglang_engines_import_sglang_0_5_23_where_they_run(in_tmp: Path) -> None:
    cfg, _ = load_recipe(RECIPES / "tiny_moe_cpu_dapo_sglang.yaml", [f"checkpoint.dir={in_tmp / 'ckpt'}"])
    outcome = check_install(cfg)
    assert outcome.figures["sglang"] == "0.5.23"
    assert any(line.startswith(f"sglang 0.5.23 imports under {sglang_python()}") for line in outcome.lines)


def test_sglang_engines_under_a_python_without_sglang_fail_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SGLANG_PYTHON_ENV, sys.executable)  # this venv: the trainer's, without sglang
    with pytest.raises(StepFailure) as failure:
        install.check_sglang()
    assert f"`import sglang` fails under {sys.executable} (${SGLANG_PYTHON_ENV})" in failure.value.cause
    assert "ModuleNotFoundError" in failure.value.cause
    assert "./launch/setup.sh --sglang" in failure.value.fix


# --- inputs ----------------------------------------------------------------------------------------------------


def test_inputs_pass_on_the_tiny_recipe_writing_only_under_preflight(in_tmp: Path) -> None:
    cfg = _tiny(in_tmp)
    outcome = check_inputs(cfg)
    assert outcome.lines[0].startswith("model.random_init: the weights are initialised at random")
    assert outcome.figures["train_rows"] == 2048 and outcome.figures["val_greedy_rows"] == 64
    assert outcome.figures["tokenizer_tokens"] == 18
    assert outcome.figures["sample_rewards"] == [1.0, 1.0, 1.0]  # each ground truth then <eos>: correct
    assert [path.name for path in (in_tmp / "runs" / cfg.name).iterdir()] == ["preflight"]
    assert not (in_tmp / "ckpt").exists()


def _sharded_checkpoint(directory: Path) -> Path:
    """The tiny Qwen3-MoE checkpoint split into two shards (layers 0-1 with the embedding; the rest) and an index."""
    save_tiny_moe(directory)
    tensors = load_file(directory / SINGLE_FILE)
    (directory / SINGLE_FILE).unlink()
    first = {n for n in tensors if n.startswith(("model.embed_tokens", "model.layers.0.", "model.layers.1."))}
    shards = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": set(tensors) - first}
    for file, names in shards.items():
        save_file({name: tensors[name] for name in names}, directory / file, metadata={"format": "pt"})
    weight_map = {name: file for file, names in shards.items() for name in names}
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def _model_recipe(tmp_path: Path, model_dir: Path, *overrides: str) -> RunConfig:
    return _tiny(tmp_path, "model.random_init=null", f"model.path={model_dir}", *overrides)


def test_a_sharded_checkpoint_passes_and_a_missing_shard_fails_naming_it_and_model_path(in_tmp: Path) -> None:
    model_dir = _sharded_checkpoint(in_tmp / "model")
    cfg = _model_recipe(in_tmp, model_dir)
    outcome = check_inputs(cfg)
    assert outcome.figures["model_shards"] == 2 and outcome.figures["model_tensors"] == 77
    assert outcome.lines[0] == f"{model_dir}: 2 weight files, 77 tensors, every one Qwen3MoeForCausalLM needs"
    (model_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(StepFailure) as failure:
        check_inputs(cfg)
    assert "model-00002-of-00002.safetensors, which is not in" in failure.value.cause
    assert failure.value.fix.startswith("model.path:")


def test_a_shard_without_a_tensor_its_index_maps_to_it_fails_naming_the_file(in_tmp: Path) -> None:
    model_dir = _sharded_checkpoint(in_tmp / "model")
    cfg = _model_recipe(in_tmp, model_dir)
    shard = model_dir / "model-00002-of-00002.safetensors"
    tensors = load_file(shard)
    del tensors["model.layers.3.self_attn.q_proj.weight"]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(StepFailure) as failure:
        check_inputs(cfg)
    assert f"{shard} does not hold what {INDEX_FILE} maps to it: 1 named there are absent" in failure.value.cause
    assert "model.layers.3.self_attn.q_proj.weight" in failure.value.cause
    assert failure.value.fix.startswith("model.path:")


def test_fp8_rollouts_are_converted_later_or_need_each_projections_scale(in_tmp: Path) -> None:
    fp8 = ("rollout.quantization=fp8", "rollout.fp8_block_size=[16, 16]")
    random_init = _tiny(in_tmp, *fp8)
    later = check_inputs(random_init).lines[1]
    assert (
        later
        == f"FP8 rollouts: runs/{random_init.name}/rollout_fp8 is not there yet; the run converts the model into it at start"
    )
    fp8_dir = convert_hf_to_fp8(save_tiny_moe(in_tmp / "model"), in_tmp / "fp8", (16, 16))
    cfg = _model_recipe(in_tmp, in_tmp / "model", *fp8, f"rollout.fp8_checkpoint={fp8_dir}")
    assert "holds 55 FP8 projections, each with its weight_scale_inv" in check_inputs(cfg).lines[1]
    scale = "model.layers.2.mlp.experts.3.down_proj.weight_scale_inv"
    tensors = load_file(fp8_dir / SINGLE_FILE)  # one file: the tiny model is far below a shard's size
    del tensors[scale]
    save_file(tensors, fp8_dir / SINGLE_FILE, metadata={"format": "pt"})
    with pytest.raises(StepFailure) as failure:
        check_inputs(cfg)
    assert f"{fp8_dir}: 1 FP8 projections have no weight_scale_inv" in failure.value.cause
    assert "model.layers.2.mlp.experts.3.down_proj.weight" in failure.value.cause
    assert failure.value.fix.startswith("rollout.fp8_checkpoint:")


def _parquet_recipe(tmp_path: Path, rows: dict[str, list[Any]], *overrides: str) -> tuple[RunConfig, Path]:
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table(rows), path)
    tokenizer = save_synthetic_tokenizer(tmp_path / "tokenizer")
    data = (
        "data.synthetic=null",
        f"data.train_files=[{path}]",
        "validation.interval=0",
        f"model.tokenizer={tokenizer}",
    )
    return _tiny(tmp_path, *data, *overrides), path


def test_a_parquet_without_the_answer_column_fails_naming_the_file_the_column_and_answer_key(in_tmp: Path) -> None:
    cfg, path = _parquet_recipe(in_tmp, {"prompt": ["succ 1", "succ 4"], "data_source": ["a", "b"]})
    with pytest.raises(StepFailure) as failure:
        check_inputs(cfg)
    assert failure.value.cause == (
        f"{path}: no column 'reward_model' for data.answer_key='reward_model.ground_truth'; "
        "its columns are ['prompt', 'data_source']"
    )
    assert failure.value.fix.startswith("data.answer_key: name the column of train.parquet that holds the reference")


def test_a_parquet_with_the_columns_passes_and_its_rows_are_scored(in_tmp: Path) -> None:
    answers = [{"ground_truth": str(digit + 1)} for digit in range(4)]
    cfg, path = _parquet_recipe(in_tmp, {"prompt": [f"succ {d}" for d in range(4)], "reward_model": answers})
    outcome = check_inputs(cfg)
    assert f"{path}: 4 rows, columns 'prompt' and 'reward_model.ground_truth'" in outcome.lines
    assert outcome.figures["train_rows"] == 4 and outcome.figures["sample_rewards"] == [1.0, 1.0, 1.0]
    assert "reward synthetic_successor: '1<eos>' scores +1 (correct: True)" in outcome.lines


def test_what_data_preparation_refuses_fails_with_the_field_its_message_names(in_tmp: Path) -> None:
    with pytest.raises(StepFailure) as failure:
        check_inputs(_tiny(in_tmp, "rollout.max_prompt_length=2"))
    assert "no prompts left" in failure.value.cause and "rollout.max_prompt_length" in failure.value.cause
    assert failure.value.fix.startswith("data.synthetic: change it")


def raises_on_an_answer(response: str, ground_truth: str, extra_info: Mapping[str, Any]) -> RewardOutput:
    """A reward that passes the start-up probe (the empty response) and raises on any answer."""
    if not response:
        return RewardOutput(score=-1.0, correct=False)
    raise KeyError("no parser for this answer")


def test_a_reward_that_raises_on_a_row_fails_naming_data_reward(in_tmp: Path) -> None:
    reward = f"{__name__}:raises_on_an_answer"
    with pytest.raises(StepFailure) as failure:
        check_inputs(_tiny(in_tmp, f"data.reward={reward}"))
    assert failure.value.cause.startswith(f"data.reward {reward} ({__name__}.raises_on_an_answer) raised KeyError")
    assert "response 'Answer: " in failure.value.cause  # a reward not shipped here is given an Answer: line
    assert failure.value.fix.startswith("data.reward:")


# --- storage ---------------------------------------------------------------------------------------------------


def test_storage_measures_both_rates_and_leaves_nothing_behind(in_tmp: Path) -> None:
    cfg = _tiny(in_tmp, f"checkpoint.dir={in_tmp / 'ckpt' / 'nested'}")
    outcome = check_storage(cfg, nbytes=8 << 20)
    assert set(outcome.rates) == {"fs_write_gbps", "fs_read_gbps"}
    for rate in outcome.rates.values():
        assert rate.value > 0 and rate.unit == "GB/s"
        assert rate.source == f"storage: 8 MiB written, fsynced and read back in {in_tmp / 'ckpt' / 'nested'}"
    assert list(in_tmp.iterdir()) == []  # the file and the directories it created are gone
    (in_tmp / "ckpt").mkdir()
    check_storage(_tiny(in_tmp), nbytes=1 << 20)
    assert list((in_tmp / "ckpt").iterdir()) == []  # an existing directory is kept, empty as it was


def test_a_checkpoint_dir_under_a_file_fails_naming_the_directory_and_the_error(in_tmp: Path) -> None:
    (in_tmp / "a_file").write_text("not a directory")
    directory = in_tmp / "a_file" / "checkpoints"
    with pytest.raises(StepFailure) as failure:
        check_storage(_tiny(in_tmp, f"checkpoint.dir={directory}"), nbytes=1 << 20)
    assert failure.value.cause.startswith(f"the checkpoint directory {directory} cannot be written: ")
    assert "Error: [Errno" in failure.value.cause
    assert failure.value.fix.startswith("checkpoint.dir:")
    assert os.listdir(in_tmp) == ["a_file"]
