"""The tool-calling episodes: a turn's call parsed, the tool run in its worker process, the reply's ids appended.

A small byte-level BPE tokenizer with Qwen3's chat and tool tokens stands in for Qwen3's (no download).
The turn a model samples need not be the tokenizer's own segmentation of its text: the tests give the
episode such a turn and show that re-tokenising the conversation would change the ids (what a
text-in/text-out rollout would then train on), while the episode appends the reply's ids to the ids
sampled, leaving them as they are.
"""

from __future__ import annotations

import json

import pytest

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.data import PromptItem
from megatron_rl.data.synthetic_tokenizer import build_synthetic_tokenizer
from megatron_rl.rollout.episodes import build_episode
from megatron_rl.tools.calls import render_tool_responses
from tests.qwen3_chat import CALL, CHAT_TOKENS, build_qwen3_like_tokenizer

INTERVAL = "tests.faults.tools:interval"


@pytest.fixture(scope="module")
def tokenizer():
    return build_qwen3_like_tokenizer()


def _episode(tokenizer, **fields):
    fields = {"tools": ["calculator"], "tool_num_workers": 1, **fields}
    return build_episode(RolloutConfig(episode="tool_calls", **fields), tokenizer)


def _characters(tokenizer, text: str) -> list[int]:
    """``text`` as the model may sample it: a token per character (chat tokens whole), not the BPE segmentation."""
    ids: list[int] = []
    for piece in text.replace("<tool_call>", "\0<tool_call>\0").replace("</tool_call>", "\0</tool_call>\0").split("\0"):
        if piece in CHAT_TOKENS:
            ids.append(tokenizer.convert_tokens_to_ids(piece))
        else:
            ids += [i for char in piece for i in tokenizer.encode(char, add_special_tokens=False)]
    return ids


def test_a_call_is_answered_with_the_tool_message_ids_and_sampled_ids_stay_as_sampled(tokenizer):
    episode = _episode(tokenizer)
    try:
        assert episode.stop_token_ids == (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
        item = PromptItem(0, tokenizer.encode("<|im_start|>user\nwhat is 12 * 7?<|im_end|>\n"), "84", "test")
        turn = _characters(tokenizer, "I will compute it.\n" + CALL) + [tokenizer.eos_token_id]
        assert tokenizer.decode(turn) == "I will compute it.\n" + CALL + "<|im_end|>"
        future = episode.reply(item, turn, turns=1)
        assert future is not None
        reply = future.result(timeout=60)
        assert reply.calls() == (("calculator", None),)
        assert reply.ids == tokenizer.encode(render_tool_responses(["84"]), add_special_tokens=False)
        # What the next turn continues from: the ids sampled, then the reply's, never the text re-tokenised.
        sent = [*item.prompt_ids, *turn, *reply.ids]
        retokenised = tokenizer.encode(tokenizer.decode(sent), add_special_tokens=False)
        assert tokenizer.decode(retokenised) == tokenizer.decode(sent) and retokenised != sent
    finally:
        episode.close()


def test_turns_without_a_call_or_past_max_turns_end_the_episode_and_bad_calls_get_an_error(tokenizer):
    episode = _episode(tokenizer, max_turns=2)
    end = tokenizer.eos_token_id
    try:
        item = PromptItem(0, [1, 2], "84", "test")
        answer = tokenizer.encode("the answer is 84", add_special_tokens=False) + [end]
        assert episode.reply(item, answer, turns=1) is None
        assert episode.reply(item, [*_characters(tokenizer, CALL), end], turns=2) is None  # the last turn: not run
        assert episode.reply(item, _characters(tokenizer, CALL), turns=1) is None  # cut at its length: no end
        bad = tokenizer.encode(
            '<tool_call>\n{"name": "calculator", "arguments": 3}\n</tool_call>', add_special_tokens=False
        )
        reply = episode.reply(item, [*bad, end], turns=1).result(timeout=60)
        assert reply.calls() == ((None, "error"),)
        assert '"arguments" of a tool call must be a JSON object' in tokenizer.decode(reply.ids)
        unknown = CALL.replace("calculator", "browser")
        reply = episode.reply(item, [*_characters(tokenizer, unknown), end], turns=1).result(timeout=60)
        assert reply.failure == "error" and "unknown tool 'browser'" in tokenizer.decode(reply.ids)
    finally:
        episode.close()


def _token_ids(tokenized: object) -> list[int]:
    """What ``apply_chat_template`` returns tokenized (transformers types it as any of its outputs), as ids."""
    assert isinstance(tokenized, list) and all(isinstance(i, int) for i in tokenized), tokenized
    return tokenized


def test_the_synthetic_episode_reply_is_the_chat_template_rendering_of_the_tool_message():
    tokenizer = build_synthetic_tokenizer(tools=True)
    rollout = RolloutConfig(episode="synthetic_tool_calls", tools=["synthetic_lookup"], max_turns=2, tool_num_workers=1)
    episode = build_episode(rollout, tokenizer)
    try:
        prompt = _token_ids(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": "ask 3"}], add_generation_prompt=True, return_dict=False
            )
        )
        context = {"tools_kwargs": {"synthetic_lookup": {"table": "0123456789", "key": 3}}}
        item = PromptItem(0, list(prompt), "3", "test", context)
        call = tokenizer.convert_tokens_to_ids("<call>")
        assert isinstance(call, int)  # one token, one id
        replied = episode.reply(item, [call], turns=1)
        assert replied is not None, "the episode replies to a turn that ends at <call>"
        reply = replied.result(timeout=60)
        answer = tokenizer.encode("3", add_special_tokens=False) + [tokenizer.eos_token_id]
        conversation = [
            {"role": "user", "content": "ask 3"},
            {"role": "assistant", "content": "<call>"},
            {"role": "tool", "content": "3"},
            {"role": "assistant", "content": "3"},
        ]
        assert [*item.prompt_ids, call, *reply.ids, *answer] == list(
            tokenizer.apply_chat_template(conversation, return_dict=False)
        )
    finally:
        episode.close()


def test_an_episode_of_the_wrong_chat_format_is_refused_naming_the_field():
    rollout = RolloutConfig(episode="tool_calls", tools=["calculator"])
    with pytest.raises(ValueError, match=r"rollout.episode: 'tool_calls' ends a turn at '<\|im_end\|>'"):
        build_episode(rollout, build_synthetic_tokenizer())


def _call(name: str, arguments: dict[str, object]) -> str:
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(arguments) + "}\n</tool_call>"


def test_two_calls_of_a_turn_run_in_parallel_and_the_reply_is_the_templates_two_tool_messages(tokenizer):
    episode = _episode(tokenizer, tools=[INTERVAL], tool_num_workers=2)
    try:
        question = [{"role": "user", "content": "wait twice"}]
        prompt = tokenizer.apply_chat_template(question, add_generation_prompt=True, return_dict=False)
        item = PromptItem(0, list(prompt), "", "test")
        text = "Both at once.\n" + _call("interval", {"seconds": 1.0}) + "\n" + _call("interval", {"seconds": 1.0})
        turn = [*_characters(tokenizer, text), tokenizer.eos_token_id]
        reply = episode.reply(item, turn, turns=1).result(timeout=60)
        assert reply.calls() == (("interval", None), ("interval", None))
        # The outputs (start and end times) are read back from the reply's text, in the template's layout.
        outputs = tokenizer.decode(reply.ids).split("<tool_response>\n")[1:]
        (start_a, end_a), (start_b, end_b) = (map(float, out.partition("\n")[0].split()) for out in outputs)
        assert start_a < end_b and start_b < end_a, "the two calls did not overlap: they ran one after the other"
        outputs = [out.partition("\n</tool_response>")[0] for out in outputs]
        calls = [{"type": "function", "function": {"name": "interval", "arguments": {"seconds": 1.0}}}] * 2
        conversation = [
            *question,
            {"role": "assistant", "content": "Both at once.", "tool_calls": calls},
            *({"role": "tool", "content": output} for output in outputs),
        ]
        rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert tokenizer.decode([*prompt, *turn, *reply.ids]) == rendered
        after_turn = rendered.partition("</tool_call><|im_end|>")[2]
        assert reply.ids == tokenizer.encode(after_turn, add_special_tokens=False)
    finally:
        episode.close()


def test_calls_past_max_tool_calls_per_turn_are_not_run_and_their_reply_names_the_field(tokenizer):
    episode = _episode(tokenizer, max_tool_calls_per_turn=1)
    try:
        item = PromptItem(0, [1, 2], "", "test")
        text = _call("calculator", {"expression": "1 + 2"}) + "\n" + _call("calculator", {"expression": "3 + 4"})
        reply = episode.reply(item, [*_characters(tokenizer, text), tokenizer.eos_token_id], turns=1).result(60)
        assert reply.calls() == (("calculator", None), (None, "error"))
        limit = "error: not run; a turn may make at most 1 tool calls (rollout.max_tool_calls_per_turn=1)"
        assert tokenizer.decode(reply.ids) == render_tool_responses(["3", limit + "; make fewer calls per turn"])
    finally:
        episode.close()


def test_max_tool_calls_per_turn_must_be_positive():
    with pytest.raises(ValueError, match="max_tool_calls_per_turn"):
        RolloutConfig(max_tool_calls_per_turn=0)
