"""Reward registry, import-path loading and the reward contract check."""

from __future__ import annotations

import math
import pickle
import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from megatron_rl.data import (
    RewardContractError,
    RewardOutput,
    check_reward_contract,
    get_reward,
    register_reward,
    registered_rewards,
    rewards,
)

CUSTOM_MODULE = "custom_reward_for_test"


def length_reward(response: str, ground_truth: str, extra_info: Mapping[str, Any]) -> RewardOutput:
    return RewardOutput(score=float(len(response)), correct=response == ground_truth)


def other_length_reward(response: str, ground_truth: str, extra_info: Mapping[str, Any]) -> RewardOutput:
    return RewardOutput(score=0.0, correct=False)


def two_argument_reward(response: str, ground_truth: str) -> RewardOutput:
    return RewardOutput(score=0.0, correct=False)


def float_reward(response: str, ground_truth: str, extra_info: Mapping[str, Any]) -> float:
    return 1.0


def crashing_reward(response: str, ground_truth: str, extra_info: Mapping[str, Any]) -> RewardOutput:
    raise KeyError("difficulty")


def always_correct_reward(response: str, ground_truth: str, extra_info: Mapping[str, Any]) -> RewardOutput:
    return RewardOutput(score=1.0, correct=True)


@pytest.fixture
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rewards, "_REGISTRY", dict(rewards._REGISTRY))


@pytest.fixture
def custom_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / f"{CUSTOM_MODULE}.py").write_text(
        textwrap.dedent(
            """
            from megatron_rl.data import RewardOutput

            def exact(response, ground_truth, extra_info):
                correct = response.strip() == ground_truth
                return RewardOutput(score=1.0 if correct else 0.0, correct=correct)

            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, CUSTOM_MODULE, raising=False)
    yield CUSTOM_MODULE
    sys.modules.pop(CUSTOM_MODULE, None)


def test_builtin_rewards_are_registered_and_honour_the_contract() -> None:
    assert {"math_dapo", "math_equiv", "math_01", "synthetic_successor", "synthetic_max"} <= set(registered_rewards())
    for name in registered_rewards():
        check_reward_contract(get_reward(name))
        assert pickle.loads(pickle.dumps(get_reward(name))) is get_reward(name)


def test_unknown_reward_name_lists_registered_ones() -> None:
    with pytest.raises(ValueError, match="unknown reward 'nope'.*math_01, math_dapo"):
        get_reward("nope")


def test_register_reward_adds_a_name(isolated_registry: None) -> None:
    assert register_reward("length")(length_reward) is length_reward
    assert get_reward("length") is length_reward
    assert register_reward("length")(length_reward) is length_reward


def test_register_reward_refuses_a_taken_name(isolated_registry: None) -> None:
    register_reward("length")(length_reward)
    with pytest.raises(ValueError, match="already registered to .*length_reward"):
        register_reward("length")(other_length_reward)


def test_register_reward_refuses_nested_functions_and_bad_names(isolated_registry: None) -> None:
    def nested(response: str, ground_truth: str, extra_info: Mapping[str, Any]) -> RewardOutput:
        return RewardOutput(score=0.0, correct=False)

    with pytest.raises(RewardContractError, match="module top level"):
        register_reward("nested")(nested)
    with pytest.raises(ValueError, match="no ':'"):
        register_reward("a:b")


def test_import_path_loads_a_custom_reward(custom_module: str) -> None:
    fn = get_reward(f"{custom_module}:exact")
    check_reward_contract(fn)
    assert fn(" 4 ", "4", {}) == RewardOutput(score=1.0, correct=True)
    assert pickle.loads(pickle.dumps(fn)) is fn


def test_import_path_errors_name_module_and_attribute(custom_module: str) -> None:
    with pytest.raises(ValueError, match="cannot import module 'no_such_reward_module'"):
        get_reward("no_such_reward_module:score")
    with pytest.raises(ValueError, match=f"module '{custom_module}' has no attribute 'missing'"):
        get_reward(f"{custom_module}:missing")
    with pytest.raises(TypeError, match="NOT_CALLABLE is a int"):
        get_reward(f"{custom_module}:NOT_CALLABLE")
    with pytest.raises(ValueError, match="package.module:function"):
        get_reward(f"{custom_module}:")


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (lambda response, ground_truth, extra_info: RewardOutput(0.0, False), "lambda or closure"),
        (two_argument_reward, "must accept"),
        (float_reward, "returned float"),
        (crashing_reward, "raised KeyError on probe"),
        (always_correct_reward, "judges the empty response correct"),
        (42, "not callable"),
    ],
)
def test_contract_check_rejects_bad_reward_functions(fn: Any, message: str) -> None:
    with pytest.raises(RewardContractError, match=message):
        check_reward_contract(fn)


def test_contract_check_rejects_closures() -> None:
    def make() -> Any:
        def closure(response: str, ground_truth: str, extra_info: Mapping[str, Any]) -> RewardOutput:
            return RewardOutput(0.0, False)

        return closure

    with pytest.raises(RewardContractError, match="lambda or closure"):
        check_reward_contract(make())


def test_reward_output_is_validated_and_frozen() -> None:
    output = RewardOutput(score=1, correct=True)
    assert isinstance(output.score, float)
    with pytest.raises(AttributeError):
        output.score = 2.0  # type: ignore[misc]
    with pytest.raises(ValueError, match="finite"):
        RewardOutput(score=math.nan, correct=False)
    with pytest.raises(TypeError, match="correct must be a bool"):
        RewardOutput(score=1.0, correct=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="score must be a float"):
        RewardOutput(score="1", correct=True)  # type: ignore[arg-type]
