"""Multi-turn tool use: the model's turn ends at a tool call, the tool runs, its output is appended as tokens.

Two chat formats, one episode each:

- ``tool_calls``: Qwen3's (Hermes) format. A turn ends at the ``</tool_call>`` token; the call is the
  JSON between ``<tool_call>`` and it; the reply is the tool message as Qwen3's chat template renders
  it, followed by the header of the model's next turn (:func:`~megatron_rl.tools.calls.render_tool_response`).
- ``synthetic_tool_calls``: the synthetic tokenizer's format (the tiny CPU recipes): a turn ends at the
  one token ``<call>``, which calls the recipe's one tool (``rollout.tools``) with no arguments; the reply
  renders as ``" <tool> {output} <assistant>"``. One token, so a randomly initialised model can find the
  call by sampling.

The tool runs in :class:`~megatron_rl.rollout.tool_pool.ToolPool`'s worker processes with the prompt
row's ``extra_info["tools_kwargs"][tool]`` as its context. A turn without a call ends the episode, as
does the ``rollout.max_turns``-th turn; a malformed call, or a tool that fails, gets an error message as
its reply and the episode goes on. A reply is encoded alone (``add_special_tokens=False``) and appended
to the ids so far: nothing sampled is ever re-tokenised.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Literal

from megatron_rl.data.synthetic_tokenizer import ASSISTANT_TOKEN, CALL_TOKEN, TOOL_TOKEN
from megatron_rl.rollout.episodes import EnvironmentReply, Episode, EpisodeSetup, register_episode
from megatron_rl.rollout.tool_pool import ToolOutput, ToolPool
from megatron_rl.tools.calls import ToolCall, ToolCallError, parse_tool_call, render_tool_response
from megatron_rl.tools.registry import tool_call_name

if TYPE_CHECKING:
    from megatron_rl.data import PromptItem

TOOL_KWARGS_KEY = "tools_kwargs"
"""The ``extra_info`` key of a prompt row holding each tool's per-episode context (verl's convention)."""


class ToolEpisode(Episode):
    """Multi-turn tool use in one chat format (see the module docstring); :meth:`close` stops the tool workers."""

    def __init__(self, setup: EpisodeSetup, stop_token: str) -> None:
        rollout, tokenizer = setup.rollout, setup.tokenizer
        if not rollout.tools:
            raise ValueError(f"rollout.tools: episode {rollout.episode!r} calls tools; name at least one")
        stop_id = tokenizer.convert_tokens_to_ids(stop_token)
        if not isinstance(stop_id, int) or stop_id == tokenizer.unk_token_id:
            raise ValueError(
                f"rollout.episode: {rollout.episode!r} ends a turn at {stop_token!r}, which the tokenizer does not "
                "have as a token; pick the episode of the model's chat format"
            )
        self.stop_token_ids = (stop_id,)
        self.max_turns = rollout.max_turns
        self.tool_names = tuple(rollout.tools)
        self._decode: Callable[[list[int]], str] = lambda ids: str(tokenizer.decode(ids, skip_special_tokens=False))
        self._encode: Callable[[str], list[int]] = lambda text: list(tokenizer.encode(text, add_special_tokens=False))
        self.tools = ToolPool(rollout.tools, rollout.tool_num_workers, rollout.tool_timeout_s)

    @abstractmethod
    def parse(self, turn_text: str) -> ToolCall | None:
        """The tool call that ends ``turn_text`` (None: no call, the turn is an answer); ToolCallError when malformed."""

    @abstractmethod
    def render(self, output: str) -> str:
        """The text appended after a call: the tool message with ``output`` and the model's next turn header."""

    def reply(self, item: PromptItem, turn_ids: list[int], turns: int) -> Future[EnvironmentReply] | None:
        """The tool's output after a turn ending in a call, None after a turn without one or the last turn."""
        if turns >= self.max_turns or not turn_ids or turn_ids[-1] not in self.stop_token_ids:
            return None
        try:
            call = self.parse(self._decode(turn_ids))
        except ToolCallError as exc:
            return _done(EnvironmentReply(self._encode(self.render(f"error: {exc}")), failure="error"))
        if call is None:
            return None
        context = (item.extra_info.get(TOOL_KWARGS_KEY) or {}).get(call.name) or {}
        result: Future[EnvironmentReply] = Future()

        def rendered(done: Future[ToolOutput]) -> None:
            try:
                output = done.result()
                result.set_result(EnvironmentReply(self._encode(self.render(output.text)), call.name, _failure(output)))
            except BaseException as exc:  # the pool closed under it: the manager must not wait forever
                result.set_exception(exc)

        self.tools.submit(call, context).add_done_callback(rendered)
        return result

    def close(self) -> None:
        """Stop the tool workers."""
        self.tools.close()


@register_episode("tool_calls")
class HermesToolEpisode(ToolEpisode):
    """Qwen3's tool-call format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

    def __init__(self, setup: EpisodeSetup) -> None:
        super().__init__(setup, "</tool_call>")

    def parse(self, turn_text: str) -> ToolCall | None:
        """The JSON call closing the turn (:func:`~megatron_rl.tools.calls.parse_tool_call`)."""
        return parse_tool_call(turn_text)

    def render(self, output: str) -> str:
        """Qwen3's tool message and the next assistant header (:func:`~megatron_rl.tools.calls.render_tool_response`)."""
        return render_tool_response(output)


@register_episode("synthetic_tool_calls")
class SyntheticToolEpisode(ToolEpisode):
    """The synthetic tokenizer's one-token call of the recipe's one tool (see the module docstring)."""

    def __init__(self, setup: EpisodeSetup) -> None:
        if len(setup.rollout.tools) != 1:
            raise ValueError(
                f"rollout.tools: the synthetic_tool_calls episode calls one tool; got {setup.rollout.tools}"
            )
        super().__init__(setup, CALL_TOKEN)

    def parse(self, turn_text: str) -> ToolCall | None:
        """The recipe's tool, without arguments (the turn ended at ``<call>``)."""
        return ToolCall(tool_call_name(self.tool_names[0]), {})

    def render(self, output: str) -> str:
        """``" <tool> {output} <assistant>"``: the synthetic chat template's tool message and next turn."""
        return f" {TOOL_TOKEN} {output} {ASSISTANT_TOKEN}"


def _failure(output: ToolOutput) -> Literal["error", "timeout", "limit"] | None:
    """The reply's failure: a timeout, a limit's stop, or an error (the tool raised, died, or does not exist)."""
    if output.failure is None or output.failure in ("timeout", "limit"):
        return output.failure
    return "error"


def _done(reply: EnvironmentReply) -> Future[EnvironmentReply]:
    future: Future[EnvironmentReply] = Future()
    future.set_result(reply)
    return future
