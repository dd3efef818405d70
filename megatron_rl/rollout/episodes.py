"""Episodes: how a response unfolds over the model's turns, and what the environment appends between them.

The rollout manager sends every request itself (windows, seeds, aborts and crash recovery stay its
job, so they hold for every episode); an :class:`Episode` says which tokens end a model turn
(:attr:`Episode.stop_token_ids`, besides EOS) and, after each turn that ended at a stop token, what the
environment appends before the model's next turn (:meth:`Episode.reply`), or that the episode is over.
The next turn's prompt is the previous prompt ids, the sampled ids and the reply's ids, never a
re-tokenised text (token-in/token-out): the trainer trains on exactly the ids the engine sampled,
with their log-probs, and the reply's ids are masked out of the loss.

A recipe names its episode in ``rollout.episode``: a registered name (:func:`register_episode`:
``single_turn``, the default, and the tool-calling episodes of :mod:`tool_episode`) or an import
path ``package.module:factory``; a factory takes an :class:`EpisodeSetup` and returns the episode.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from megatron_rl.named_functions import find_function, register_function

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.data import PromptItem

ReplyFailure = Literal["error", "timeout", "limit"]
"""Why a call gave no result (see :class:`EnvironmentReply`)."""


@dataclass(frozen=True)
class EnvironmentReply:
    """What the environment appends after a model turn: ``ids`` (the rendered tool message and the header
    of the model's next turn), the ``tool`` it ran (None: no tool ran, e.g. a malformed call) and why the
    tool gave no result (``failure``: ``error`` or ``timeout``, ``ids`` then render an error message the
    model reads; ``limit``: a limit of the tool stopped the work, ``ids`` render what it output until then).
    A turn of several calls: ``tool`` and ``failure`` are its first call's, ``more_calls`` the ``(tool, failure)``
    of the others, in order, and ``ids`` render every reply."""

    ids: list[int]
    tool: str | None = None
    failure: ReplyFailure | None = None
    more_calls: tuple[tuple[str | None, ReplyFailure | None], ...] = ()

    def calls(self) -> tuple[tuple[str | None, ReplyFailure | None], ...]:
        """The ``(tool, failure)`` of every call this reply answers, in order (one for a turn of one call)."""
        return ((self.tool, self.failure), *self.more_calls)


@dataclass(frozen=True)
class EpisodeSetup:
    """What an episode factory gets: the run's rollout settings and the tokenizer of the model's chat format."""

    rollout: RolloutConfig
    tokenizer: PreTrainedTokenizerBase


class Episode(ABC):
    """How the environment answers the model's turns (see the module docstring).

    Implementations must be thread-safe: :meth:`reply` is called from the rollout manager's loop while
    earlier replies are still running, and a training and a validation manager may share one episode.
    """

    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a model turn besides EOS (the engine includes the stop token in the output)."""

    @abstractmethod
    def reply(self, item: PromptItem, turn_ids: list[int], turns: int) -> Future[EnvironmentReply] | None:
        """The environment's reply to a model turn that ended at a stop token or EOS, or None when the
        episode is over. ``turn_ids``: the ids the model sampled in that turn (the stop token last);
        ``turns``: the model's turns so far, this one included. A reply must not raise: a tool that fails
        replies with an error message (:attr:`EnvironmentReply.failure`)."""

    def close(self) -> None:  # noqa: B027  (optional: most episodes start nothing)
        """Release what the episode started (tool workers); no :meth:`reply` follows."""


class SingleTurn(Episode):
    """One model turn per response: every response ends at EOS or the length budget."""

    def __init__(self, setup: EpisodeSetup | None = None) -> None:
        del setup  # nothing to set up

    def reply(self, item: PromptItem, turn_ids: list[int], turns: int) -> None:
        """Always None: the response is over after its one turn."""
        return None


EpisodeFactory = Callable[[EpisodeSetup], Episode]
_REGISTRY: dict[str, EpisodeFactory] = {}


def register_episode(name: str) -> Callable[[EpisodeFactory], EpisodeFactory]:
    """Decorator registering a top-level episode factory (a class taking an :class:`EpisodeSetup`, or a function)."""
    return register_function(_REGISTRY, "episode", name, TypeError)


register_episode("single_turn")(SingleTurn)


def episode_factory(name: str) -> EpisodeFactory:
    """The factory ``rollout.episode`` names: a registered name or ``package.module:factory``.

    Raises:
        ValueError: an unknown name (listing the registered ones), or an import path that does not resolve
            to a callable; each names ``rollout.episode``.
    """
    from megatron_rl.rollout import tool_episode  # noqa: F401  (registers the tool-calling episodes)

    try:
        return find_function(_REGISTRY, "episode", name)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"rollout.episode: {exc}") from exc


def check_episode(rollout: RolloutConfig) -> list[str]:
    """Raise ValueError, naming the field, when ``rollout.episode`` or a tool of ``rollout.tools`` does not
    resolve; return, one message each, the tools that cannot run on this machine (the python tool where
    its sandbox cannot be set up for this user: the message names the cause and the fix; not with
    ``rollout.tool_sandbox``, whose service runs the code). Cheap: starts nothing but
    :func:`~megatron_rl.tools.sandbox_problem`'s trial sandbox.

    The caller decides what a machine problem is: an error for ``train`` and ``validate --strict``, a
    warning for plain ``validate`` (a recipe checked on a login node that is not where it runs)."""
    from megatron_rl.rollout.tool_pool import sandbox_service
    from megatron_rl.tools import get_tool, tool_problem
    from megatron_rl.tools.sandbox_service import service_in_use

    episode_factory(rollout.episode)
    problems = []
    with service_in_use(sandbox_service(rollout.tool_sandbox)):  # as the tool workers will see it
        for name in rollout.tools:
            try:
                problem = tool_problem(get_tool(name))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"rollout.tools: {exc}") from exc
            if problem is not None:
                problems.append(f"rollout.tools: {name!r} cannot run on this machine: {problem}")
    return problems


def build_episode(rollout: RolloutConfig, tokenizer: PreTrainedTokenizerBase) -> Episode:
    """The episode ``rollout.episode`` names, built for ``tokenizer``'s chat format (tool workers started)."""
    episode = episode_factory(rollout.episode)(EpisodeSetup(rollout, tokenizer))
    if not isinstance(episode, Episode):
        raise ValueError(f"rollout.episode: {rollout.episode!r} built a {type(episode).__name__}, not an Episode")
    return episode
