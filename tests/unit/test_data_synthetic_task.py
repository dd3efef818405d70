"""Synthetic task: tokenizer round trip, verl-layout prompt files, and the exact-answer reward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from megatron_rl.data import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    SYNTHETIC_PROMPT_FORMATS,
    SYNTHETIC_TASKS,
    SYNTHETIC_VOCAB,
    SYNTHETIC_VOCAB_SIZE,
    build_synthetic_tokenizer,
    check_reward_contract,
    get_reward,
    load_prompt_dataset,
    save_synthetic_tokenizer,
    synthetic_exact,
    synthetic_rows,
    write_synthetic_dataset,
)
from megatron_rl.data.synthetic_task import synthetic_lookup_answer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return AutoTokenizer.from_pretrained(save_synthetic_tokenizer(tmp_path_factory.mktemp("tokenizer")))


def answer_of(prompt: str, extra_info: dict[str, Any]) -> str:
    operator, *digits = prompt.split()
    values = [int(digit) for digit in digits]
    if operator == "ask":  # the row's own table, which only the tool reads
        lookup = extra_info["tools_kwargs"]["synthetic_lookup"]
        assert lookup["key"] == values[0] and len(lookup["table"]) == 10
        return lookup["table"][values[0]]
    return str((values[0] + 1) % 10) if operator == "succ" else str(max(values))


def test_vocabulary_is_small_and_fixed() -> None:
    assert SYNTHETIC_VOCAB_SIZE == len(SYNTHETIC_VOCAB) == 18
    assert (PAD_TOKEN_ID, EOS_TOKEN_ID, BOS_TOKEN_ID) == (0, 1, 2)
    assert SYNTHETIC_VOCAB[6:16] == tuple("0123456789")


def test_tokenizer_round_trips_through_auto_tokenizer(tokenizer: Any) -> None:
    assert len(tokenizer) == SYNTHETIC_VOCAB_SIZE
    assert tokenizer.convert_ids_to_tokens(list(range(SYNTHETIC_VOCAB_SIZE))) == list(SYNTHETIC_VOCAB)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) == (0, 1, 2)
    ids = tokenizer.encode("max 37", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == ["max", "3", "7"]
    assert tokenizer.decode(ids) == "max 3 7"
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("succ x", add_special_tokens=False)) == ["succ", "<unk>"]
    assert tokenizer.decode([SYNTHETIC_VOCAB.index("4"), EOS_TOKEN_ID]) == "4 <eos>"
    assert tokenizer.decode([SYNTHETIC_VOCAB.index("4"), EOS_TOKEN_ID], skip_special_tokens=True) == "4"


def test_chat_template_renders_the_generation_prompt(tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "succ 3"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<bos> <user> succ 3 <assistant>"
    history = [*messages, {"role": "assistant", "content": "4"}]
    assert tokenizer.apply_chat_template(history, tokenize=False) == "<bos> <user> succ 3 <assistant> 4 <eos>"
    with pytest.raises(Exception, match="unsupported role system"):
        tokenizer.apply_chat_template([{"role": "system", "content": "x"}], tokenize=False)


@pytest.mark.parametrize("task", sorted(SYNTHETIC_TASKS))
def test_rows_are_seeded_and_answers_follow_the_task_rule(task: str) -> None:
    rows = synthetic_rows(task, 1000, seed=1, split="train")
    assert rows == synthetic_rows(task, 1000, seed=1, split="train")
    assert rows != synthetic_rows(task, 1000, seed=2, split="train")
    assert rows != synthetic_rows(task, 1000, seed=1, split="val")
    for row in rows:
        assert row["reward_model"]["ground_truth"] == answer_of(row["prompt"], row["extra_info"])
        assert row["data_source"] == f"synthetic_{task}"
    assert len({row["prompt"] for row in rows}) == (100 if task == "max" else 10)
    if task == "lookup":  # the answers of one prompt differ from row to row: no prompt tells its answer
        assert len({row["reward_model"]["ground_truth"] for row in rows if row["prompt"] == "ask 3"}) == 10
    chat = synthetic_rows(task, 1000, seed=1, split="train", prompt_format="chat")
    assert [row["prompt"] for row in chat] == [[{"role": "user", "content": row["prompt"]}] for row in rows]


@pytest.mark.parametrize(("prompt_format", "length"), [("text", 3), ("chat", 6)])
def test_written_dataset_loads_through_the_normal_dataset_path(
    tmp_path: Path, tokenizer: Any, prompt_format: str, length: int
) -> None:
    assert prompt_format in SYNTHETIC_PROMPT_FORMATS
    files = write_synthetic_dataset(tmp_path, task="max", prompt_format=prompt_format, num_train=40, num_val=8)
    assert pq.read_table(files.val).num_rows == 8
    dataset = load_prompt_dataset(files.train, tokenizer, max_prompt_length=8)
    assert len(dataset) == 40 and dataset.num_filtered == 0
    for item in dataset:
        assert len(item.prompt_ids) == length and max(item.prompt_ids) < SYNTHETIC_VOCAB_SIZE
        tokens = tokenizer.convert_ids_to_tokens(item.prompt_ids)
        if prompt_format == "chat":
            assert tokens[:2] == ["<bos>", "<user>"] and tokens[-1] == "<assistant>"
            tokens = tokens[2:-1]
        assert tokens[0] == "max"
        assert item.ground_truth == str(max(int(digit) for digit in tokens[1:]))
        assert item.extra_info["task"] == "max"


def test_reward_scores_the_decoded_reference_answer_plus_one(tmp_path: Path, tokenizer: Any) -> None:
    files = write_synthetic_dataset(tmp_path, task="successor", num_train=20, num_val=4, seed=0)
    reward = get_reward("synthetic_successor")
    for item in load_prompt_dataset(files.train, tokenizer, max_prompt_length=8):
        reference = tokenizer.decode([SYNTHETIC_VOCAB.index(item.ground_truth), EOS_TOKEN_ID])
        assert reward(reference, item.ground_truth, item.extra_info).score == 1.0


@pytest.mark.parametrize(
    ("response", "correct"),
    [
        ("4 <eos>", True),
        ("4<eos>", True),
        (" 4 <eos> <pad> <pad>", True),
        ("5 <eos>", False),
        ("4", False),
        ("4 4 <eos>", False),
        ("4 <eos> 4", False),
        ("44 <eos>", False),
        ("<eos>", False),
        ("", False),
        ("4 " + "7 " * 500, False),
        ("succ 3 4 <eos>", False),
    ],
)
def test_reward_requires_exactly_the_answer_then_eos(response: str, correct: bool) -> None:
    output = synthetic_exact(response, "4", {})
    assert output.correct is correct
    assert output.score == (1.0 if correct else -1.0)


def test_every_task_has_its_reward_registered_under_its_data_source() -> None:
    check_reward_contract(synthetic_exact)
    check_reward_contract(synthetic_lookup_answer)
    for task in SYNTHETIC_TASKS:
        (row,) = synthetic_rows(task, 1, seed=0, split="train")
        expected = synthetic_lookup_answer if task == "lookup" else synthetic_exact
        assert get_reward(row["data_source"]) is expected


@pytest.mark.parametrize(
    ("response", "correct"),
    [
        ("<call> <tool> 4 <assistant> 4 <eos>", True),
        ("<call> <tool> 4 <assistant> 4 <eos> <pad>", True),
        ("<call> <tool> 4 <assistant> 5 <eos>", False),
        ("4 <eos>", False),  # a guess, right or not, is no lookup
        ("<call> <tool> 4 <assistant> 4", False),
        ("<call> <tool> 4 <assistant> <call>", False),
        ("<call> <tool> 4 <assistant> 4 4 <eos>", False),
        ("<tool> 4 <assistant> 4 <eos>", False),
        ("", False),
    ],
)
def test_the_lookup_reward_takes_the_final_answer_only_after_a_lookup(response: str, correct: bool) -> None:
    output = synthetic_lookup_answer(response, "4", {})
    assert output.correct is correct and output.score == (1.0 if correct else -1.0)


def test_the_answer_a_response_votes_for_is_its_final_tokens() -> None:
    # Correctness depends on the answer alone, so responses that vote together are judged alike.
    assert (
        synthetic_exact("4 <eos> <pad> <pad>", "4", {}).answer == synthetic_exact("4<eos>", "4", {}).answer == "4 <eos>"
    )
    assert synthetic_exact("4", "4", {}).answer == "4"
    assert synthetic_exact("<pad>", "4", {}).answer is None
    assert synthetic_lookup_answer("<call> <tool> 4 <assistant> 4 <eos>", "4", {}).answer == "4 <eos>"
    assert synthetic_lookup_answer("4 <eos>", "4", {}).answer is None  # no lookup, no answer


def test_the_tool_tokens_are_in_the_lookup_tokenizer_only() -> None:
    plain, tools = build_synthetic_tokenizer(), build_synthetic_tokenizer(tools=True)
    assert len(plain) == SYNTHETIC_VOCAB_SIZE and len(tools) == SYNTHETIC_VOCAB_SIZE + 3
    assert tools.convert_ids_to_tokens([18, 19, 20]) == ["ask", "<call>", "<tool>"]
    assert plain.decode([SYNTHETIC_VOCAB.index("4"), 19, EOS_TOKEN_ID]) == "4 <eos>"  # as it always decoded


def test_unknown_task_or_format_lists_the_available_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown synthetic task 'sum'; available: successor, max"):
        write_synthetic_dataset(tmp_path, task="sum")
    with pytest.raises(ValueError, match="unknown synthetic prompt_format 'json'; available: text, chat"):
        write_synthetic_dataset(tmp_path, prompt_format="json")
