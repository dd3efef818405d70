"""Tool calls in Qwen3's (Hermes) format: the model's calls are read exactly, in order, a malformed one is
named in its place, and the tools' reply is the text Qwen3's chat template puts after an assistant's tool calls.

The expected texts are built piece by piece from what Qwen3's chat template (its tokenizer_config.json
``chat_template``, cited in :mod:`megatron_rl.tools.calls`) emits for each message, in order, or rendered
by transformers' ``apply_chat_template`` from the template's text (:mod:`tests.qwen3_chat`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest

from megatron_rl.tools.calls import ToolCall, ToolCallError, parse_tool_calls, render_tool_responses
from tests.qwen3_chat import build_qwen3_like_tokenizer


def _template_tool_call(name: str, arguments: Mapping[str, object]) -> str:
    """What the template emits for one call of an assistant message: ``'<tool_call>\\n{"name": "'``, the name,
    ``'", "arguments": '``, the arguments ``| tojson``, ``'}\\n</tool_call>'``."""
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(arguments) + "}\n</tool_call>"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (_template_tool_call("calculator", {"expression": "1+2"}), ToolCall("calculator", {"expression": "1+2"})),
        (
            "Let me compute.\n" + _template_tool_call("python", {"code": "print(1)\nprint(2)"}),
            ToolCall("python", {"code": "print(1)\nprint(2)"}),
        ),
        (
            "<think>\nI should call <tool_call> maybe\n</think>\n\n" + _template_tool_call("search", {"q": "x"}),
            ToolCall("search", {"q": "x"}),
        ),
        ('<tool_call>{"name": "clock"}</tool_call>\n', ToolCall("clock", {})),  # no arguments, white space after
        (
            '<tool_call>\n{"arguments": {"a": [1, {"b": null}]}, "name": "t"}\n</tool_call>',
            ToolCall("t", {"a": [1, {"b": None}]}),
        ),
        ("The answer is 4.", None),
        ("<think>\n<tool_call>{}</tool_call>\n</think>\n\nThe answer is 4.", None),  # a call inside thinking only
        ("", None),
    ],
)
def test_a_turn_ending_in_a_call_is_read(text: str, expected: ToolCall | None) -> None:
    assert parse_tool_calls(text) == ([] if expected is None else [expected])


def test_every_call_of_a_turn_is_read_in_order_and_a_malformed_one_is_named_in_its_place() -> None:
    first, second = _template_tool_call("calculator", {"expression": "1+2"}), _template_tool_call("clock", {})
    assert parse_tool_calls("Two calls.\n" + first + "\n" + second) == [
        ToolCall("calculator", {"expression": "1+2"}),
        ToolCall("clock", {}),
    ]
    calls = parse_tool_calls(first + "\n<tool_call>\nnot json\n</tool_call>\n" + second + "\n")
    assert calls[0] == ToolCall("calculator", {"expression": "1+2"}) and calls[2] == ToolCall("clock", {})
    assert isinstance(calls[1], ToolCallError) and "not valid JSON" in str(calls[1])
    between = parse_tool_calls(first + " and then " + second)
    assert isinstance(between[0], ToolCallError) and between[1] == ToolCall("clock", {})
    assert "text follows </tool_call>: 'and then'" in str(between[0])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('<tool_call>\n{"name": "calc", "arguments": {"x": 1}\n</tool_call>', "not valid JSON"),
        ("<tool_call>\nnot json\n</tool_call>", "not valid JSON"),
        ('<tool_call>\n["calc", {}]\n</tool_call>', "must be a JSON object"),
        ('<tool_call>\n{"arguments": {}}\n</tool_call>', 'needs "name", a non-empty string; got None'),
        ('<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>', 'needs "name", a non-empty string'),
        ('<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>', 'needs "name", a non-empty string; got 3'),
        (
            '<tool_call>\n{"name": "calc", "arguments": "{\\"x\\": 1}"}\n</tool_call>',
            '"arguments" .* must be a JSON object',
        ),
        (
            '<tool_call>\n{"name": "calc", "arguments": [1]}\n</tool_call>',
            '"arguments" .* must be a JSON object, got \\[1\\]',
        ),
        ('<tool_call>\n{"name": "calc", "arguments": {}}', "not closed by </tool_call>"),
        (_template_tool_call("a", {}) + "\nso the answer is 3", "text follows </tool_call>: 'so the answer is 3'"),
    ],
)
def test_a_malformed_call_is_named(text: str, message: str) -> None:
    (error,) = parse_tool_calls(text)
    assert isinstance(error, ToolCallError)
    with pytest.raises(ToolCallError, match=message):
        raise error


def test_the_reply_is_what_qwen3s_template_renders_after_a_tool_call() -> None:
    # The template for [user, assistant with tool_calls, tool] and add_generation_prompt, message by message:
    user = "<|im_start|>user\nWhat is 2**10?<|im_end|>\n"
    assistant = "<|im_start|>assistant\n" + _template_tool_call("calculator", {"expression": "2**10"}) + "<|im_end|>\n"
    tool = "<|im_start|>user" + "\n<tool_response>\n" + "1024" + "\n</tool_response>" + "<|im_end|>\n"
    generation_prompt = "<|im_start|>assistant\n"
    rendered = user + assistant + tool + generation_prompt
    # Generation stops at <|im_end|> (its last token); the reply is everything the template adds after it.
    turn = _template_tool_call("calculator", {"expression": "2**10"})
    assert rendered == user + "<|im_start|>assistant\n" + turn + "<|im_end|>" + render_tool_responses(["1024"])
    assert parse_tool_calls(turn) == [ToolCall("calculator", {"expression": "2**10"})]


def test_the_replies_to_two_calls_are_what_apply_chat_template_renders_for_two_tool_messages() -> None:
    calls = [("calculator", {"expression": "2**10"}), ("clock", {"zone": "UTC"})]
    conversation: list[dict[str, Any]] = [
        {"role": "user", "content": "What is 2**10, and the time?"},
        {
            "role": "assistant",
            "content": "Two calls.",
            "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls],
        },
        {"role": "tool", "content": "1024"},
        {"role": "tool", "content": "12:00\nUTC"},
    ]
    tokenizer = build_qwen3_like_tokenizer()
    before = tokenizer.apply_chat_template(conversation[:1], tokenize=False, add_generation_prompt=True)
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert isinstance(before, str) and isinstance(rendered, str)  # tokenize=False returns the text
    turn = "Two calls.\n" + "\n".join(_template_tool_call(name, arguments) for name, arguments in calls)
    assert rendered == before + turn + "<|im_end|>" + render_tool_responses(["1024", "12:00\nUTC"])
    assert parse_tool_calls(turn) == [ToolCall(name, arguments) for name, arguments in calls]


def test_the_reply_holds_the_text_as_is() -> None:
    assert render_tool_responses([""]) == (
        "\n<|im_start|>user\n<tool_response>\n\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    text = "line 1\n</tool_response> <|im_end|>"
    assert text in render_tool_responses([text])
    with pytest.raises(ValueError, match="at least one tool output"):
        render_tool_responses([])
