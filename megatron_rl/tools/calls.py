"""Tool calls in Qwen3's (Hermes) chat format: reading the model's call, writing the tool's reply.

Read in Qwen3's chat template (the ``chat_template`` of Qwen3's ``tokenizer_config.json``, e.g. the
Qwen3-4B card's copy in akougkas/warpio-cli ``warpio-docs/ai-docs/model_cards/qwen3:4b.md``, and TRL's
``trl/chat_template_utils.py`` ``qwen3_chat_template``, which TRL matches against Qwen/Qwen3-0.6B's):

- an assistant tool call renders as ``<tool_call>\\n{"name": "<name>", "arguments": <json object>}\\n</tool_call>``
  (after the turn's content and a newline when there is content), then the turn's ``<|im_end|>\\n``;
- a tool message renders inside a user turn: ``<|im_start|>user`` (opened once for consecutive tool
  messages), then ``\\n<tool_response>\\n`` + content + ``\\n</tool_response>``, then ``<|im_end|>\\n``;
- the generation prompt is ``<|im_start|>assistant\\n``. (Qwen3-2507 thinking models add ``<think>\\n``
  to it, and the template adds ``<think>\\n\\n</think>\\n\\n`` when ``enable_thinking=False``; this module
  writes the plain header and leaves such prefixes to the model.)

``<tool_call>``, ``</tool_call>``, ``<tool_response>`` and ``</tool_response>`` are single tokens of
Qwen3's vocabulary (ids 151657, 151658, 151665, 151666), not special tokens: they survive decoding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
THINK_CLOSE = "</think>"


class ToolCallError(ValueError):
    """A turn's tool call is malformed; the message says what is wrong, for the model to read."""


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and the JSON object of its arguments."""

    name: str
    arguments: dict[str, Any]


def parse_tool_call(text: str) -> ToolCall | None:
    """The tool call that ends the turn ``text``, or None when the turn calls no tool (a final answer).

    Only text after the last ``</think>`` counts (thinking may mention calls). A call is
    ``<tool_call>`` + a JSON object ``{"name": str, "arguments": object}`` + ``</tool_call>``, with
    only white space after it; white space around the JSON is ignored and missing ``arguments``
    reads as ``{}``. ToolCallError when ``<tool_call>`` appears but the call is malformed: not at the
    end, unterminated, more than one call (one call per turn), not JSON, not an object, an empty or
    non-string ``name``, ``arguments`` not an object. ``<tool_call>`` is a vocabulary token a model
    emits only to call, so its presence decides that the turn meant to call.
    """
    content = text.rpartition(THINK_CLOSE)[2]
    if TOOL_CALL_OPEN not in content:
        return None
    call = content.partition(TOOL_CALL_OPEN)[2]
    if TOOL_CALL_OPEN in call:
        raise ToolCallError(f"more than one {TOOL_CALL_OPEN} in the turn; call one tool per turn")
    body, closed, after = call.partition(TOOL_CALL_CLOSE)
    if not closed:
        raise ToolCallError(f"the tool call is not closed by {TOOL_CALL_CLOSE}")
    if after.strip():
        raise ToolCallError(f"text follows {TOOL_CALL_CLOSE}: {after.strip()[:80]!r}; the call must end the turn")
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


def render_tool_response(text: str) -> str:
    """The text that follows a turn ending in ``</tool_call>``: Qwen3's tool message holding ``text``, then
    the header of the model's next turn.

    ``<|im_end|>\\n`` closes the assistant's turn (generation stopped at ``</tool_call>``, before it),
    then the one tool message as the template renders it, then ``<|im_start|>assistant\\n``. ``text`` is
    put in as is (the template does not escape it either).
    """
    return f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{text}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
