"""Tool calls in Qwen3's (Hermes) chat format: reading the model's call, writing the tool's reply.

Read in Qwen3's chat template (the ``chat_template`` of Qwen3's ``tokenizer_config.json``, e.g. the
Qwen3-4B card's copy in akougkas/warpio-cli ``warpio-docs/ai-docs/model_cards/qwen3:4b.md``, and TRL's
``trl/chat_template_utils.py`` ``qwen3_chat_template``, which TRL matches against Qwen/Qwen3-0.6B's):

- an assistant tool call renders as ``<tool_call>\\n{"name": "<name>", "arguments": <json object>}\\n</tool_call>``
  (after the turn's content and a newline when there is content; several calls are separated by ``\\n``),
  then the turn's ``<|im_end|>\\n``;
- a tool message renders inside a user turn: ``<|im_start|>user`` (opened once for consecutive tool
  messages), then ``\\n<tool_response>\\n`` + content + ``\\n</tool_response>``, then ``<|im_end|>\\n``
  (after the last of consecutive tool messages);
- the generation prompt is ``<|im_start|>assistant\\n``. (Qwen3-2507 thinking models add ``<think>\\n``
  to it, and the template adds ``<think>\\n\\n</think>\\n\\n`` when ``enable_thinking=False``; this module
  writes the plain header and leaves such prefixes to the model.)

``<tool_call>``, ``</tool_call>``, ``<tool_response>`` and ``</tool_response>`` are single tokens of
Qwen3's vocabulary (ids 151657, 151658, 151665, 151666), not special tokens: they survive decoding.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
THINK_CLOSE = "</think>"
TURN_END = "<|im_end|>"
"""Ends a message in Qwen3's template: the model's turn of calls ends at it (its EOS as a chat model)."""


class ToolCallError(ValueError):
    """A turn's tool call is malformed; the message says what is wrong, for the model to read."""


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and the JSON object of its arguments."""

    name: str
    arguments: dict[str, Any]


def parse_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """Every tool call of the turn ``text``, in order; empty when the turn calls no tool (a final answer).

    ``text`` is the turn without its end (``<|im_end|>``). Only text after the last ``</think>`` counts
    (thinking may mention calls). The calls start at the first ``<tool_call>``; each is ``<tool_call>`` + a
    JSON object ``{"name": str, "arguments": object}`` + ``</tool_call>``, calls separated by white space only
    (Qwen3's template puts a newline between them; SGLang's Qwen2.5/Qwen3 detector reads every such block).
    White space around the JSON is ignored and missing ``arguments`` reads as ``{}``. A malformed block is a
    ToolCallError in its place, saying what is wrong for the model to read: unterminated, followed by text,
    not JSON, not an object, an empty or non-string ``name``, ``arguments`` not an object. ``<tool_call>`` is
    a vocabulary token a model emits only to call, so its presence decides that the turn meant to call.
    """
    content = text.rpartition(THINK_CLOSE)[2]
    if TOOL_CALL_OPEN not in content:
        return []
    blocks = content.split(TOOL_CALL_OPEN)[1:]
    calls: list[ToolCall | ToolCallError] = []
    for block in blocks:
        try:
            calls.append(_parse_block(block))
        except ToolCallError as exc:
            calls.append(exc)
    return calls


def _parse_block(block: str) -> ToolCall:
    """One call from the text between its ``<tool_call>`` and the next (or the turn's end); ToolCallError when malformed."""
    body, closed, after = block.partition(TOOL_CALL_CLOSE)
    if not closed:
        raise ToolCallError(f"the tool call is not closed by {TOOL_CALL_CLOSE}")
    if after.strip():
        raise ToolCallError(
            f"text follows {TOOL_CALL_CLOSE}: {after.strip()[:80]!r}; calls must end the turn, after any text"
        )
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as exc:
        raise ToolCallError(f"the tool call is not valid JSON ({exc}): {body.strip()[:200]!r}") from exc
    if not isinstance(payload, dict):
        raise ToolCallError(
            f'the tool call must be a JSON object {{"name": ..., "arguments": {{...}}}}, got {body.strip()[:200]!r}'
        )
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        raise ToolCallError(f'the tool call needs "name", a non-empty string; got {name!r}')
    arguments = payload.get("arguments", {})
    if not isinstance(arguments, dict):
        raise ToolCallError(f'"arguments" of a tool call must be a JSON object, got {json.dumps(arguments)[:200]}')
    return ToolCall(name, arguments)


def render_tool_responses(texts: Sequence[str]) -> str:
    """The text that follows a turn of tool calls ended by ``<|im_end|>``: Qwen3's tool messages holding
    ``texts`` (one per call, in order), then the header of the model's next turn.

    ``\n`` ends the assistant's turn (the template's ``<|im_end|>\n``; the model sampled ``<|im_end|>``),
    then the consecutive tool messages as the template renders them, in one user turn, then
    ``<|im_start|>assistant\n``. Each text is put in as is (the template does not escape it either).
    ValueError when ``texts`` is empty (a turn without calls gets no reply).
    """
    if not texts:
        raise ValueError("render_tool_responses needs at least one tool output")
    responses = "".join(f"\n<tool_response>\n{text}\n</tool_response>" for text in texts)
    return f"\n<|im_start|>user{responses}<|im_end|>\n<|im_start|>assistant\n"
