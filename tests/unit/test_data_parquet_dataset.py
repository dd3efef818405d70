"""Parquet prompt datasets in the verl column layout: both prompt forms, filtering, errors."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl.data import SYNTHETIC_VOCAB, build_synthetic_tokenizer, load_prompt_dataset

ID = {token: index for index, token in enumerate(SYNTHETIC_VOCAB)}
CHAT_SUCC_3 = [ID["<bos>"], ID["<user>"], ID["succ"], ID["3"], ID["<assistant>"]]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_synthetic_tokenizer()


def write(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def verl_row(prompt: Any, answer: Any = "4", **extra: Any) -> dict[str, Any]:
    return {
        "data_source": "unit",
        "prompt": prompt,
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "train", "index": 7, **extra},
    }


def test_chat_message_prompts_go_through_the_chat_template(tmp_path: Path, tokenizer: Any) -> None:
    path = write(tmp_path / "chat.parquet", [verl_row([{"role": "user", "content": "succ 3"}])])
    dataset = load_prompt_dataset(path, tokenizer, max_prompt_length=16)
    item = dataset[0]
    assert item.prompt_ids == CHAT_SUCC_3
    assert (item.index, item.ground_truth, item.data_source) == (0, "4", "unit")
    assert item.extra_info == {"split": "train", "index": 7}


def test_plain_string_prompts_are_tokenised_as_is_or_wrapped(tmp_path: Path, tokenizer: Any) -> None:
    path = write(tmp_path / "plain.parquet", [verl_row("succ 3")])
    plain = load_prompt_dataset(path, tokenizer, max_prompt_length=16)
    wrapped = load_prompt_dataset(path, tokenizer, max_prompt_length=16, wrap_text_in_chat=True)
    assert plain[0].prompt_ids == [ID["succ"], ID["3"]]
    assert wrapped[0].prompt_ids == CHAT_SUCC_3


def test_files_concatenate_in_order_with_contiguous_indices(tmp_path: Path, tokenizer: Any) -> None:
    first = write(tmp_path / "a.parquet", [verl_row("succ 1", "2"), verl_row("succ 2", "3")])
    second = write(tmp_path / "b.parquet", [verl_row("succ 3", 4)])
    dataset = load_prompt_dataset([first, second], tokenizer, max_prompt_length=None)
    assert [item.index for item in dataset] == [0, 1, 2]
    assert [item.ground_truth for item in dataset] == ["2", "3", "4"]


def test_over_long_prompts_are_filtered_and_counted(
    tmp_path: Path, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    rows = [verl_row("succ 1"), verl_row("max 1 2"), verl_row("succ 2"), verl_row("max 1 2 3 4")]
    path = write(tmp_path / "mixed.parquet", rows)
    with caplog.at_level(logging.INFO, logger="megatron_rl.data"):
        dataset = load_prompt_dataset(path, tokenizer, max_prompt_length=2)
    assert len(dataset) == 2 and dataset.num_filtered == 2
    assert [item.prompt_ids[0] for item in dataset] == [ID["succ"], ID["succ"]]
    assert [item.index for item in dataset] == [0, 1]
    assert "filtered 2 longer than max_prompt_length=2" in caplog.text
    assert load_prompt_dataset(path, tokenizer, max_prompt_length=None).num_filtered == 0


def test_filtering_every_prompt_is_an_error(tmp_path: Path, tokenizer: Any) -> None:
    path = write(tmp_path / "long.parquet", [verl_row("max 1 2")])
    with pytest.raises(ValueError, match="no prompts left .*1 longer than max_prompt_length=2"):
        load_prompt_dataset(path, tokenizer, max_prompt_length=2)


def test_missing_prompt_column_names_file_and_column(tmp_path: Path, tokenizer: Any) -> None:
    path = write(tmp_path / "noprompt.parquet", [{"question": "succ 1", "reward_model": {"ground_truth": "2"}}])
    with pytest.raises(ValueError, match=r"noprompt\.parquet: no column 'prompt' for key 'prompt'.*question"):
        load_prompt_dataset(path, tokenizer, max_prompt_length=8)


def test_missing_answer_field_names_file_key_and_field(tmp_path: Path, tokenizer: Any) -> None:
    path = write(tmp_path / "noanswer.parquet", [verl_row("succ 1")])
    with pytest.raises(ValueError, match=r"noanswer\.parquet: key 'reward_model.answer'.*no field 'answer'"):
        load_prompt_dataset(path, tokenizer, max_prompt_length=8, answer_key="reward_model.answer")
    with pytest.raises(ValueError, match=r"noanswer\.parquet: no column 'solution' for key 'solution'"):
        load_prompt_dataset(path, tokenizer, max_prompt_length=8, answer_key="solution")


def test_custom_keys_and_optional_columns(tmp_path: Path, tokenizer: Any) -> None:
    path = write(tmp_path / "flat.parquet", [{"question": "succ 5", "answer": "6"}])
    dataset = load_prompt_dataset(path, tokenizer, max_prompt_length=8, prompt_key="question", answer_key="answer")
    assert dataset[0].prompt_ids == [ID["succ"], ID["5"]]
    assert (dataset[0].ground_truth, dataset[0].data_source, dataset[0].extra_info) == ("6", "flat", {})


def test_bad_prompt_values_name_the_row(tmp_path: Path, tokenizer: Any) -> None:
    path = write(tmp_path / "bad.parquet", [verl_row([{"role": "user", "content": "succ 1"}]), verl_row([])])
    with pytest.raises(ValueError, match=r"bad\.parquet row 1 key 'prompt'"):
        load_prompt_dataset(path, tokenizer, max_prompt_length=8)


def test_chat_prompts_need_a_chat_template(tmp_path: Path) -> None:
    tokenizer = build_synthetic_tokenizer()
    tokenizer.chat_template = None
    path = write(tmp_path / "chat.parquet", [verl_row([{"role": "user", "content": "succ 3"}])])
    with pytest.raises(ValueError, match="no chat_template"):
        load_prompt_dataset(path, tokenizer, max_prompt_length=8)


def test_missing_file_is_named(tmp_path: Path, tokenizer: Any) -> None:
    with pytest.raises(FileNotFoundError, match="absent.parquet"):
        load_prompt_dataset(tmp_path / "absent.parquet", tokenizer, max_prompt_length=8)


def test_chat_template_kwargs_reach_the_template(tmp_path: Path) -> None:
    tokenizer = build_synthetic_tokenizer()
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %} {{ m['content'] }}{% endfor %}{% if closed %} <eos>{% endif %}"
    )
    path = write(tmp_path / "chat.parquet", [verl_row([{"role": "user", "content": "succ 3"}])])
    closed = load_prompt_dataset(path, tokenizer, max_prompt_length=8, chat_template_kwargs={"closed": True})
    assert closed[0].prompt_ids == [ID["<bos>"], ID["succ"], ID["3"], ID["<eos>"]]
    assert load_prompt_dataset(path, tokenizer, max_prompt_length=8)[0].prompt_ids == [ID["<bos>"], ID["succ"], ID["3"]]
