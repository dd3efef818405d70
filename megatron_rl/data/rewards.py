"""Reward-function registry, the reward contract, and its start-up check.

Contract: a reward function is a module-level callable

    fn(response: str, ground_truth: str, extra_info: Mapping[str, Any]) -> RewardOutput

``response`` is the decoded response text, ``ground_truth`` the dataset's answer string and
``extra_info`` the row's ``extra_info`` dict (empty when the dataset has none). Functions run in
worker processes, so they must be picklable by reference: defined at module top level, not
lambdas, closures or methods. The empty response must be judged wrong: a response whose reward
raises or times out during a run scores as the empty response does (see
``megatron_rl.rollout.scoring``), so that score is the reward's own score of a wrong answer.
"""

from __future__ import annotations

import inspect
import math
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from megatron_rl.config.schema import JUDGE_REWARD, REMOTE_REWARD
from megatron_rl.named_functions import find_function, qualified_name, register_function


@dataclass(frozen=True, slots=True)
class RewardOutput:
    """The score of one response, whether its answer is correct, and the answer it gave.

    ``score`` is what the advantage estimator sees (e.g. +1/-1); ``correct`` feeds accuracy
    metrics, dynamic sampling and length-bias diagnostics, independently of the score scale.
    ``answer`` is the response's final answer in the reward's normal form, None when it gave none:
    majority voting (``maj@k``) counts responses with equal answers as one vote each for that
    answer, so two answers the reward judges equal must have the same normal form.
    """

    score: float
    correct: bool
    answer: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.score, bool) or not isinstance(self.score, (int, float)):
            raise TypeError(f"RewardOutput.score must be a float, got {type(self.score).__name__}")
        if not math.isfinite(self.score):
            raise ValueError(f"RewardOutput.score must be finite, got {self.score}")
        if not isinstance(self.correct, bool):
            raise TypeError(f"RewardOutput.correct must be a bool, got {type(self.correct).__name__}")
        if self.answer is not None and not isinstance(self.answer, str):
            raise TypeError(f"RewardOutput.answer must be a str or None, got {type(self.answer).__name__}")
        object.__setattr__(self, "score", float(self.score))


class RewardFn(Protocol):
    """Signature every reward function satisfies (see the module docstring)."""

    def __call__(self, response: str, ground_truth: str, extra_info: Mapping[str, Any]) -> RewardOutput: ...


class ServedReward(Protocol):
    """A reward served from outside the workers (a reward server, the judge's engines): picklable, so each reward
    worker gets its own copy; it also reads the prompt the response answers. It raises when it gives no score."""

    def __call__(
        self, response: str, ground_truth: str, extra_info: Mapping[str, Any], prompt: str = ""
    ) -> RewardOutput: ...

    def close(self) -> None:
        """Release connections; the next call opens new ones."""


class RewardContractError(TypeError):
    """A reward function violates the contract; the message says which part and how to fix it."""


EMPTY_RESPONSE_PROBE: tuple[str, str, Mapping[str, Any]] = ("", "0", {})
"""The call that checks a reward at start, and whose score failed responses get: the empty response to answer 0."""

_F = TypeVar("_F", bound=Callable[..., RewardOutput])
_REGISTRY: dict[str, Callable[..., RewardOutput]] = {}


def register_reward(name: str) -> Callable[[_F], _F]:
    """Decorator registering a top-level reward function under ``name``; returns it unchanged.

    Re-registering the same function (e.g. when a worker re-imports its module) is a no-op;
    registering a different function under a taken name, or under the reserved ``"remote"`` or ``"judge"``, raises
    ValueError.
    """
    if name in (REMOTE_REWARD, JUDGE_REWARD):
        raise ValueError(f"reward name {name!r} is reserved for data.reward: {name} (a reward served to the workers)")
    return register_function(_REGISTRY, "reward", name, RewardContractError)


def registered_rewards() -> tuple[str, ...]:
    """Names of all registered reward functions, sorted."""
    return tuple(sorted(_REGISTRY))


def get_reward(name: str) -> RewardFn:
    """Return the reward function registered as ``name``, or import ``"package.module:function"``.

    Raises ValueError for an unknown name (listing the registered ones), an import path whose
    module cannot be imported, or whose attribute is missing; TypeError if it is not callable.
    ``"remote"`` is no function of the registry: ValueError pointing to
    :class:`~megatron_rl.data.remote_reward.RemoteReward`, which scores through ``data.remote_reward``, and so is
    ``"judge"``: the judge engines' :class:`~megatron_rl.rollout.judge_reward.JudgeReward`.
    """
    if name == REMOTE_REWARD:
        raise ValueError(
            f"reward {name!r} scores through the server of data.remote_reward: build "
            "megatron_rl.data.remote_reward.RemoteReward(data.remote_reward), as prepare_data does"
        )
    if name == JUDGE_REWARD:
        raise ValueError(
            f"reward {name!r} scores with the judge section's engines, which the run starts: "
            "megatron_rl.rollout.judge_reward.JudgeReward scores through them"
        )
    return find_function(_REGISTRY, "reward", name)


def check_reward_contract(
    fn: Callable[..., Any],
    probe: tuple[str, str, Mapping[str, Any]] = EMPTY_RESPONSE_PROBE,
) -> None:
    """Raise RewardContractError unless ``fn`` honours the reward contract.

    Checks, in order: callable; picklable by reference (module top level); has a signature
    accepting ``(response, ground_truth, extra_info)`` positionally; returns a RewardOutput when
    called on ``probe``, judged not correct (the probe's response is empty). An exception raised
    by the probe call is re-raised as RewardContractError. Returns None when every check passes.
    """
    name = qualified_name(fn)
    if not callable(fn):
        raise RewardContractError(f"reward {name} is a {type(fn).__name__}, not callable")
    if "<locals>" in getattr(fn, "__qualname__", "") or getattr(fn, "__name__", "") == "<lambda>":
        raise RewardContractError(f"reward {name} is a lambda or closure; define it at module top level")
    try:
        pickle.loads(pickle.dumps(fn))
    except (pickle.PicklingError, AttributeError, TypeError, ImportError) as exc:
        raise RewardContractError(f"reward {name} is not picklable ({exc}); define it at module top level") from exc
    try:
        inspect.signature(fn).bind(*probe)
    except (TypeError, ValueError) as exc:
        raise RewardContractError(
            f"reward {name} must accept (response: str, ground_truth: str, extra_info: Mapping) positionally: {exc}"
        ) from exc
    try:
        result = fn(*probe)
    except Exception as exc:
        raise RewardContractError(f"reward {name} raised {type(exc).__name__} on probe {probe!r}: {exc}") from exc
    if not isinstance(result, RewardOutput):
        raise RewardContractError(
            f"reward {name} returned {type(result).__name__}; it must return "
            "RewardOutput(score=float, correct=bool) from megatron_rl.data"
        )
    if result.correct:
        raise RewardContractError(
            f"reward {name} judges the empty response correct on probe {probe!r}; it must be wrong: a response "
            "whose reward raises or times out scores as the empty response"
        )
