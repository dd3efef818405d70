"""Math answer extraction, normalisation and the math_dapo / math_01 rewards."""

from __future__ import annotations

import builtins
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.data import (
    answers_match,
    extract_answer,
    extract_boxed,
    get_reward,
    is_correct_math_response,
    math_01,
    math_dapo,
    normalize_answer,
)

EQUAL = [
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("so the total is \\boxed{1,000}.", "1000"),
    ("\\boxed{-3}", "-3"),
    ("$\\boxed{\\dfrac{3}{4}}$", "3/4"),
    ("\\boxed{\\tfrac{6}{8}}", "\\frac{3}{4}"),
    ("\\boxed{\\frac12}", ".5"),
    ("\\boxed{-\\frac{1}{2}}", "-0.5"),
    ("\\boxed{0.50}", "1/2"),
    ("\\boxed{+5}", "5"),
    ("\\boxed{ 12 }", "12.0"),
    ("\\boxed{1,234,567}", "1234567"),
    ("\\boxed{50\\%}", "50"),
    ("\\boxed{90^\\circ}", "90"),
    ("\\boxed{x = 5}", "5"),
    ("\\boxed{\\text{(B)}}", "(B)"),
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)"),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),
    ("\\boxed 7$.", "7"),
    ("\\fbox{7}", "7"),
    ("first \\boxed{1}, finally \\boxed{2}", "2"),
    ("Answer: 42", "42"),
    ("answer: 1\nAnswer: $\\frac{2}{4}$.\nDone.", "0.5"),
    ("\\boxed{3.}", "3"),
    ("\\boxed{−4}", "-4"),
    ("\\boxed{6}", "\\boxed{6}"),
]

UNEQUAL = [
    ("\\boxed{2}", "3"),
    ("\\boxed{\\frac{1}{3}}", "0.33"),
    ("\\boxed{1,2}", "12"),
    ("\\boxed{-3}", "3"),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{3}"),
    ("\\boxed{1}\\boxed{2}", "1"),
    ("\\boxed{(A)}", "(B)"),
    ("\\boxed{}", "0"),
    ("\\boxed{1/0}", "0"),
]

NO_ANSWER = [
    "",
    "I think it is 5",
    "\\boxed{5",
    "\\boxed{1} then \\boxed{2",
    "Answer:",
    "__import__('os')",
]


@pytest.mark.parametrize(("response", "ground_truth"), EQUAL)
def test_equal_answers_are_correct(response: str, ground_truth: str) -> None:
    assert is_correct_math_response(response, ground_truth)


@pytest.mark.parametrize(("response", "ground_truth"), UNEQUAL)
def test_unequal_answers_are_wrong(response: str, ground_truth: str) -> None:
    assert not is_correct_math_response(response, ground_truth)


@pytest.mark.parametrize("response", NO_ANSWER)
def test_response_without_a_complete_answer_is_wrong(response: str) -> None:
    assert not is_correct_math_response(response, "5")
    assert math_dapo(response, "5", {}).score == -1.0


def test_extract_boxed_handles_nested_and_escaped_braces() -> None:
    assert extract_boxed("x \\boxed{\\frac{a}{\\sqrt{b}}} y") == "\\frac{a}{\\sqrt{b}}"
    assert extract_boxed("\\boxed{\\{x\\}}") == "\\{x\\}"
    assert extract_boxed("\\boxed{1} and \\boxed{2}") == "2"
    assert extract_boxed("\\boxed{unterminated") is None
    assert extract_boxed("\\boxedsomething") is None
    assert extract_boxed("nothing here") is None


def test_box_wins_over_answer_line() -> None:
    assert extract_answer("\\boxed{3}\nAnswer: 4") == "3"
    assert extract_answer("Answer: 4\nFinal Answer: 5 apples") == "5 apples"


def test_normalize_answer_strips_latex_decoration() -> None:
    assert normalize_answer("$\\left(\\!1,\\,2\\right)$.") == "(1,2)"
    assert normalize_answer("\\text{ yes }") == "yes"
    assert normalize_answer("\\dfrac{1}{2}") == "\\frac{1}{2}"
    assert normalize_answer("{5}") == "5"
    assert normalize_answer("\\leftarrow") == "\\leftarrow"


def test_answers_match_compares_numbers_exactly() -> None:
    assert answers_match("0.1", "\\frac{1}{10}")
    assert not answers_match("0.3333333333", "1/3")
    assert answers_match("9" * 400, "9" * 400)
    assert not answers_match("", "")


def test_math_dapo_and_math_01_scores() -> None:
    assert math_dapo("\\boxed{4}", "4", {}).score == 1.0
    assert math_dapo("\\boxed{5}", "4", {}).score == -1.0
    assert math_01("\\boxed{4}", "4", {}).score == 1.0
    assert math_01("\\boxed{5}", "4", {}).score == 0.0
    assert math_01("\\boxed{4}", "4", {}).correct and not math_01("\\boxed{5}", "4", {}).correct
    assert get_reward("math_dapo") is math_dapo
    assert get_reward("math_01") is math_01


def test_malicious_answers_are_wrong_and_never_evaluated(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("model output was evaluated")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    monkeypatch.setattr(os, "system", forbidden)
    marker = tmp_path / "pwned"
    payloads = [
        "__import__('os')",
        f"\\boxed{{__import__('os').system('touch {marker}')}}",
        f"Answer: __import__('os').system('touch {marker}')",
        "\\boxed{1+1}",
        "\\boxed{2**10}",
    ]
    for payload in payloads:
        assert math_dapo(payload, "2", {}).score == -1.0
        assert math_01(payload, "1024", {}).score == 0.0
    assert not marker.exists()


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("\\{}boxed frac $1234567890.,-/%Answer:\n")), max_size=60))
def test_arbitrary_text_never_raises(response: str) -> None:
    output = math_dapo(response, "1", {})
    assert output.score in (1.0, -1.0)
    assert output.correct is (output.score == 1.0)
