"""Data preparation from a recipe: synthetic files, tokenizer, reward resolution, the `prepare` command."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.cli import main
from megatron_rl.config import load_recipe
from megatron_rl.data.preparation import prepare_data, resolve_reward

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
TINY = RECIPES / "tiny_moe_cpu_dapo.yaml"


def test_synthetic_recipe_prepares_tokenizer_datasets_and_reward(tmp_path: Path) -> None:
    cfg, _ = load_recipe(TINY)
    prepared = prepare_data(cfg.data, tokenizer_path=None, model_vocab_size=32, max_prompt_length=16, work_dir=tmp_path)
    assert (prepared.tokenizer_dir / "tokenizer.json").is_file()
    assert cfg.data.synthetic is not None
    assert len(prepared.train) == cfg.data.synthetic.num_train
    assert prepared.val is not None and len(prepared.val) == cfg.data.synthetic.num_val
    item = prepared.train[0]
    assert (
        prepared.tokenizer.decode(item.prompt_ids)
        == f"<bos> <user> succ {(int(item.ground_truth) - 1) % 10} <assistant>"
    )
    assert prepared.reward_fn is not None
    assert prepared.reward_fn(f"{item.ground_truth}<eos>", item.ground_truth, {}).correct


def test_no_prompt_within_the_length_limit_is_an_error(tmp_path: Path) -> None:
    cfg, _ = load_recipe(TINY, ["data.synthetic.task=max"])
    with pytest.raises(ValueError, match="no prompts left .* 2048 rows, 2048 longer than max_prompt_length=2"):
        prepare_data(cfg.data, tokenizer_path=None, model_vocab_size=32, max_prompt_length=2, work_dir=tmp_path)


def test_tokenizer_larger_than_model_vocab_is_rejected(tmp_path: Path) -> None:
    cfg, _ = load_recipe(TINY)
    with pytest.raises(ValueError, match="tokenizer has 18 tokens but the model's vocab_size is 10"):
        prepare_data(cfg.data, tokenizer_path=None, model_vocab_size=10, max_prompt_length=16, work_dir=tmp_path)


def test_unknown_reward_names_the_field() -> None:
    cfg, _ = load_recipe(TINY, ["data.reward=nope"])
    with pytest.raises(ValueError, match=r"^data.reward: unknown reward 'nope'"):
        resolve_reward(cfg.data)


def test_validate_command_rejects_unknown_reward(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(TINY), "data.reward=nope"]) == 1
    assert "data.reward: unknown reward 'nope'" in capsys.readouterr().err


def test_prepare_command_prints_the_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["prepare", str(TINY), "train.prompts_per_step=4"]) == 0
    out = capsys.readouterr().out
    assert "# train: 2048 prompts, 0 filtered" in out
    assert out.count("'<bos> <user> succ ") == 4
    assert (tmp_path / "runs" / "tiny-moe-cpu-dapo" / "data" / "tokenizer" / "tokenizer.json").is_file()
