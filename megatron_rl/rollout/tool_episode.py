"""Multi-turn tool use: the model's turn ends with its tool calls, the tools run, their outputs are appended as tokens.

Two chat formats, one episode each:

- ``tool_calls``: Qwen3's (Hermes) format. A turn ends at ``<|im_end|>`` (the end of an assistant message
  in Qwen3's chat template); its calls are the ``<tool_call>`` JSON blocks of the turn, in order
  (:func:`~megatron_rl.tools.calls.parse_tool_calls`). They run in parallel, at most
  ``rollout.max_tool_calls_per_turn`` of them; the reply is their tool messages in one user turn as Qwen3's
  chat template renders them, followed by the header of the model's next turn
  (:func:`~megatron_rl.tools.calls.render_tool_responses`).
- ``synthetic_tool_calls``: the synthetic tokenizer's format (the tiny CPU recipes): a turn ends at the
  one token ``<call>``, which calls the recipe's one tool (``rollout.tools``) with no arguments; the reply
  renders as ``" <tool> {output} <assistant>"``. One call per turn, one token, so a randomly initialised
  model can find the call by sampling.

The tools run in :class:`~megatron_rl.rollout.tool_pool.ToolPool`'s worker processes with the prompt
row's ``extra_info["tools_kwargs"][tool]`` as their context. A turn without a call ends the episode, as
does the ``rollout.max_turns``-th turn; a malformed call, a call past ``rollout.max_tool_calls_per_turn``,
or a tool that fails gets an error message as its reply and the episode goes on. A reply is encoded alone
(``add_special_tokens=False``) and appended to the ids so far: nothing sampled is ever re-tokenised.
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Literal

from megatron_rl.data.synthetic_tokenizer import ASSISTANT_TOKEN, CALL_TOKEN, TOOL_TOKEN
from megatron_rl.rollout.episodes import EnvironmentReply, Episode, EpisodeSetup, register_episode
from megatron_rl.rollout.tool_pool import ToolOutput, ToolPool, sandbox_service
from megatron_rl.tools.calls import TURN_END, ToolCall, ToolCallError, parse_tool_calls, render_tool_responses
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
        self.max_calls = rollout.max_tool_calls_per_turn
        self.tool_names = tuple(rollout.tools)
        self._decode: Callable[[list[int]], str] = lambda ids: str(tokenizer.decode(ids, skip_special_tokens=False))
        self._encode: Callable[[str], list[int]] = lambda text: list(tokenizer.encode(text, add_special_tokens=False))
        sandbox = sandbox_service(rollout.tool_sandbox)
        self.tools = ToolPool(rollout.tools, rollout.tool_num_workers, rollout.tool_timeout_s, sandbox)

    @abstractmethod
    def parse(self, turn_text: str) -> list[ToolCall | ToolCallError]:
        """The tool calls of ``turn_text`` (the turn without its stop token), in order, a ToolCallError in
        place of each malformed one; empty: no call, the turn is an answer."""

    @abstractmethod
    def render(self, outputs: list[str]) -> str:
        """The text appended after a turn of calls: the tool messages with ``outputs`` (one per call, in order)
        and the model's next turn header."""

    def reply(self, item: PromptItem, turn_ids: list[int], turns: int) -> Future[EnvironmentReply] | None:
        """The tools' outputs after a turn ending in calls, None after a turn without one or the last turn.

        Every call of the turn is submitted at once (they run in parallel in the pool); the reply is
        complete when all are, its outputs in the order of the calls.
        """
        if turns >= self.max_turns or not turn_ids or turn_ids[-1] not in self.stop_token_ids:
            return None
        calls = self.parse(self._decode(turn_ids[:-1]))
        if not calls:
            return None
        context = item.extra_info.get(TOOL_KWARGS_KEY) or {}
        outputs = [self._run(call, index, context) for index, call in enumerate(calls)]
        result: Future[EnvironmentReply] = Future()
        remaining = [len(outputs)]
        lock = threading.Lock()

        def finished(_: Future[tuple[str | None, ToolOutput]]) -> None:
            with lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            try:
                answered = [output.result() for output in outputs]
                ids = self._encode(self.render([output.text for _, output in answered]))
                (tool, first), *more = [(tool, _failure(output)) for tool, output in answered]
                result.set_result(EnvironmentReply(ids, tool, first, tuple(more)))
            except BaseException as exc:  # the pool closed under it: the manager must not wait forever
                result.set_exception(exc)

        for output in outputs:
            output.add_done_callback(finished)
        return result

    def _run(
        self, call: ToolCall | ToolCallError, index: int, context: dict[str, Any]
    ) -> Future[tuple[str | None, ToolOutput]]:
        """Future of ``(tool run or None, output)`` of the turn's ``index``-th call (0-based): the tool's output, or
        an error the model reads for a malformed call or one past ``rollout.max_tool_calls_per_turn``."""
        if isinstance(call, ToolCallError):
            return _done((None, ToolOutput(f"error: {call}", "error")))
        if index >= self.max_calls:
            message = (
                f"error: not run; a turn may make at most {self.max_calls} tool calls "
                f"(rollout.max_tool_calls_per_turn={self.max_calls}); make fewer calls per turn"
            )
            return _done((None, ToolOutput(message, "error")))
        output: Future[tuple[str | None, ToolOutput]] = Future()

        def named(done: Future[ToolOutput]) -> None:
            try:
                output.set_result((call.name, done.result()))
            except BaseException as exc:
                output.set_exception(exc)

        self.tools.submit(call, context.get(call.name) or {}).add_done_callback(named)
        return output

    def close(self) -> None:
        """Stop the tool workers."""
        self.tools.close()


@register_episode("tool_calls")
class HermesToolEpisode(ToolEpisode):
    """Qwen3's tool-call format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, the turn
    ended by ``<|im_end|>``."""

    def __init__(self, setup: EpisodeSetup) -> None:
        super().__init__(setup, TURN_END)

    def parse(self, turn_text: str) -> list[ToolCall | ToolCallError]:
        """The turn's JSON calls (:func:`~megatron_rl.tools.calls.parse_tool_calls`)."""
        return parse_tool_calls(turn_text)

    def render(self, outputs: list[str]) -> str:
        """Qwen3's tool messages and the next assistant header (:func:`~megatron_rl.tools.calls.render_tool_responses`)."""
        return render_tool_responses(outputs)


@register_episode("synthetic_tool_calls")
class SyntheticToolEpisode(ToolEpisode):
    """The synthetic tokenizer's one-token call of the recipe's one tool (see the module docstring)."""

    def __init__(self, setup: EpisodeSetup) -> None:
        if len(setup.rollout.tools) != 1:
            raise ValueError(
                f"rollout.tools: the synthetic_tool_calls episode calls one tool; got {setup.rollout.tools}"
            )
        super().__init__(setup, CALL_TOKEN)

    def parse(self, turn_text: str) -> list[ToolCall | ToolCallError]:
        """The recipe's tool, without arguments (the turn ended at ``<call>``): one call."""
        return [ToolCall(tool_call_name(self.tool_names[0]), {})]

    def render(self, outputs: list[str]) -> str:
        """``" <tool> {output} <assistant>"``: the synthetic chat template's tool message (of the turn's one
        call) and next turn."""
        (output,) = outputs
        return f" {TOOL_TOKEN} {output} {ASSISTANT_TOKEN}"


def _failure(output: ToolOutput) -> Literal["error", "timeout", "limit"] | None:
    """The reply's failure: a timeout, a limit's stop, or an error (the tool raised, died, or does not exist)."""
    if output.failure is None or output.failure in ("timeout", "limit"):
        return output.failure
    return "error"


def _done[T](value: T) -> Future[T]:
    """A future already holding ``value``."""
    future: Future[T] = Future()
    future.set_result(value)
    return future
