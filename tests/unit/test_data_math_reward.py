"""Math rewards: math_dapo (the DAPO reference rule) and math_equiv / math_01 (the lenient checker)."""

from __future__ import annotations

import builtins
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.data import (
    RewardOutput,
    answers_match,
    extract_answer,
    extract_boxed,
    get_reward,
    is_correct_math_response,
    math_01,
    math_dapo,
    math_equiv,
    normalize_answer,
)
from megatron_rl.data.math_reward import (
    DAPO_WINDOW_CHARS,
    dapo_extract_answer,
    dapo_is_correct,
    dapo_normalize,
    math_answer,
)

# (response, ground truth, correct by the DAPO rule, correct by the lenient checker).
# The DAPO column is what the reference ``compute_score`` (verl/utils/reward_score/math_dapo.py)
# returns: each row was checked against the reference code itself (acc == column, score == +-1).
PAD = "The computation is done." * 20  # 480 characters, longer than the DAPO window
FORMATS = [
    # Integers and signs.
    ("Answer: 42", "42", True, True),
    ("answer: 42", "42", True, True),
    ("ANSWER : 42", "42", True, True),
    ("Final Answer: 42", "42", True, True),
    ("Answer:42", "42", True, True),
    ("Answer: -7", "-7", True, True),
    ("Answer: - 7", "-7", True, True),
    ("Answer: -7", "7", False, False),
    ("Answer: 073", "73", False, True),
    # Decimals.
    ("Answer: 0.5", "0.5", True, True),
    ("Answer: 0.5", "\\frac{1}{2}", False, True),
    ("Answer: 5.0", "5", False, True),
    ("Answer: .5", "0.5", False, True),
    ("Answer: 0.\\overline{3}", "0.3", True, False),
    # Fractions.
    ("Answer: \\frac{3}{4}", "\\frac{3}{4}", True, True),
    ("Answer: \\frac34", "\\frac{3}{4}", True, True),
    ("Answer: $\\frac{3}{4}$", "\\frac{3}{4}", True, True),
    ("Answer: \\dfrac{3}{4}", "\\frac{3}{4}", False, True),
    ("Answer: 3/4", "\\frac{3}{4}", False, True),
    ("Answer: \\frac{1}{2}", "1/2", False, True),
    ("Answer: 1/2", "1/2", True, True),
    ("Answer: -\\frac{1}{2}", "-\\frac{1}{2}", True, True),
    # Roots and symbols.
    ("Answer: 2\\sqrt{3}", "2\\sqrt{3}", True, True),
    ("Answer: 2\\sqrt3", "2\\sqrt{3}", True, False),
    ("Answer: \\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt{3}}{2}", True, True),
    ("Answer: \\pi", "\\pi", True, True),
    # Units: DAPO deletes a fixed list of unit words, the lenient checker none.
    ("Answer: 5 cm", "5", True, False),
    ("Answer: 5\\text{ cm}", "5", True, False),
    ("Answer: 5 m", "5", False, False),
    ("Answer: 5\\text{ m}", "5", True, False),
    ("Answer: 12 dollars", "12", True, False),
    ("Answer: \\$12", "12", True, False),
    ("Answer: 3 hours", "3", True, False),
    ("Answer: 7 \\text{ ways}", "7", True, False),
    ("Answer: 7 apples", "7", False, False),
    # Degrees and percent.
    ("Answer: 90^\\circ", "90", True, True),
    ("Answer: 90^{\\circ}", "90", True, True),
    ("Answer: 90 degrees", "90", True, False),
    ("Answer: 90°", "90", False, False),
    ("Answer: 25\\%", "25", False, True),
    ("Answer: 25\\%", "25\\%", True, True),
    # Boxes: DAPO reads only the Answer: line; the lenient checker prefers the last box.
    ("Answer: \\boxed{7}", "7", True, True),
    ("Answer: $\\boxed{7}$", "7", True, True),
    ("The answer is \\boxed{7}.", "7", False, True),
    ("Answer: 7\nso the result is \\boxed{3}", "7", True, False),
    ("Answer: 5", "\\boxed{5}", True, True),
    ("Answer: \\boxed{5", "5", False, False),
    # Several Answer: lines: the last one counts; on one line the first takes the rest of it.
    ("Answer: 3\nWait, let me recheck.\nAnswer: 7", "7", True, True),
    ("Answer: 7\nAnswer: 3", "7", False, False),
    ("Answer: 3 Answer: 7", "7", False, False),
    # Answer: with trailing text, assignments, punctuation.
    ("Answer: 7 because 3+4=7", "7", True, False),
    ("Answer: x = 7", "7", True, True),
    ("Answer: 7 = x", "7", False, False),
    ("Answer: 7.", "7", False, True),
    ("Answer: $7$.", "7", True, True),
    ("Answer:\n7", "7", True, False),
    ("**Answer:** 7", "7", False, False),
    # Tuples, choices, text.
    ("Answer: (1, 2)", "(1,2)", True, True),
    ("Answer: \\left(1, 2\\right)", "(1,2)", False, True),
    ("Answer: \\text{(B)}", "(B)", True, True),
    ("Answer: \\text{yes}", "yes", True, True),
    # Thousands separators.
    ("Answer: 1,000", "1000", True, True),
    ("Answer: 1000", "1,000", True, True),
    ("Answer: 1,000,000", "1000000", True, True),
    ("Answer: -1,000", "-1000", False, True),
    ("Answer: 1{,}000", "1000", True, False),
    ("Answer: 1\\,000", "1000", False, True),
    # Long responses: DAPO reads the last DAPO_WINDOW_CHARS characters only.
    ("Answer: 7\n" + PAD, "7", False, True),
    (PAD + "\nAnswer: 7", "7", True, True),
    ("Answer: 7\n" + "y" * 290, "7", True, True),  # "A" is the window's first character
    ("Answer: 7\n" + "y" * 291, "7", False, True),  # "A" is just outside: "nswer: 7"
    # Malformed and empty.
    ("", "0", False, False),
    ("Answer:", "5", False, False),
    ("Answer: ", "5", False, False),
    ("I think it is 5", "5", False, False),
    ("Answer: __import__('os')", "2", False, False),
]


@pytest.mark.parametrize(("response", "ground_truth", "dapo_correct", "equiv_correct"), FORMATS)
def test_math_dapo_follows_the_reference_and_math_equiv_stays_lenient(
    response: str, ground_truth: str, dapo_correct: bool, equiv_correct: bool
) -> None:
    scored = {
        name: fn(response, ground_truth, {})
        for name, fn in (("dapo", math_dapo), ("equiv", math_equiv), ("01", math_01))
    }
    assert (scored["dapo"].score, scored["dapo"].correct) == (1.0 if dapo_correct else -1.0, dapo_correct)
    assert (scored["equiv"].score, scored["equiv"].correct) == (1.0 if equiv_correct else -1.0, equiv_correct)
    assert (scored["01"].score, scored["01"].correct) == (1.0 if equiv_correct else 0.0, equiv_correct)
    # Majority voting needs the answer the checker compared: a correct response's answer is the ground truth's.
    if dapo_correct:
        assert scored["dapo"].answer == dapo_normalize(ground_truth)
    if equiv_correct:
        assert scored["equiv"].answer == scored["01"].answer == math_answer(f"Answer: {ground_truth}")


@pytest.mark.parametrize(
    ("responses", "answer"),
    [
        (["\\boxed{0.5}", "Answer: \\frac{1}{2}", "Answer: 1/2", "\\boxed{\\dfrac{1}{2}}"], "1/2"),
        (["Answer: 1,000", "\\boxed{1000}", "Answer: 1000."], "1000"),
        (["Answer: x=\\sqrt{2}", "\\boxed{\\sqrt{2}}"], "\\sqrt{2}"),
        (["no answer", "Answer:", ""], None),
    ],
)
def test_equal_answers_share_one_normal_form_for_voting(responses: list[str], answer: str | None) -> None:
    assert {math_answer(response) for response in responses} == {answer}
    assert {math_equiv(response, "1", {}).answer for response in responses} == {answer}


def test_the_dapo_answer_is_the_dapo_normal_form_of_the_last_answer_line() -> None:
    assert math_dapo("Answer: 5 cm\nAnswer: x = 1,000", "1000", {}).answer == "1000"
    assert math_dapo("Answer: $\\frac12$", "0.5", {}) == RewardOutput(score=-1.0, correct=False, answer="\\frac{1}{2}")
    assert math_dapo("\\boxed{4}", "4", {}).answer is None


def test_format_table_covers_disagreements_both_ways() -> None:
    assert len(FORMATS) >= 40
    assert any(dapo and not equiv for _, _, dapo, equiv in FORMATS)
    assert any(equiv and not dapo for _, _, dapo, equiv in FORMATS)


def test_dapo_extraction_reads_the_last_answer_in_the_window() -> None:
    assert DAPO_WINDOW_CHARS == 300
    assert dapo_extract_answer("Answer: 1\nAnswer:  2 apples \nmore") == "2 apples "
    assert dapo_extract_answer("answer :\n\n 3") == "3"
    assert dapo_extract_answer("\\boxed{4}") is None
    assert dapo_extract_answer("Answer: 5\n" + "y" * 300) is None


def test_dapo_normalize_steps() -> None:
    assert dapo_normalize("x = 1,000") == "1000"
    assert dapo_normalize("\\frac12") == "\\frac{1}{2}"
    assert dapo_normalize("\\sqrt2") == "\\sqrt{2}"
    assert dapo_normalize("$\\boxed{7}$") == "7"
    assert dapo_normalize("the answer is $7$ today") == "7"
    assert dapo_normalize("5\\text{ m}") == "5"
    assert dapo_normalize("12 centimeters") == "12centi"  # unit words go as substrings
    assert dapo_normalize("-1,000") == "-1,000"  # commas go only from an all-digit string
    assert dapo_normalize("0.\\overline{3}") == "0.3"


def test_math_dapo_without_an_answer_is_wrong_even_for_the_reference_placeholder() -> None:
    # The reference compares the placeholder "[INVALID]" when it finds no answer; here no answer is wrong.
    assert math_dapo("no answer here", "[INVALID]", {}) == RewardOutput(score=-1.0, correct=False)
    assert math_dapo("Answer: [INVALID]", "[INVALID]", {}).correct


def test_dapo_strict_box_mode() -> None:
    assert dapo_is_correct("so \\boxed{7}", "7", strict_box=True)
    assert not dapo_is_correct("so \\boxed{ 7}", "7", strict_box=True)  # no normalisation
    assert not dapo_is_correct("Answer: 7", "7", strict_box=True)
    assert not dapo_is_correct("\\boxed{7}" + "." * 100, "7", strict_box=True)  # before the last 100 characters
    assert dapo_is_correct("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", strict_box=True)
    assert not dapo_is_correct("\\boxed{\\frac{1}{2}", "\\frac{1}{2}", strict_box=True)


# The lenient checker (math_equiv, math_01) on boxed answers.
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
    assert math_equiv(response, "5", {}).score == -1.0


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


def test_reward_scores_and_registration() -> None:
    assert math_dapo("Answer: 4", "4", {}).score == 1.0
    assert math_dapo("Answer: 5", "4", {}).score == -1.0
    assert math_equiv("\\boxed{4}", "4", {}).score == 1.0
    assert math_equiv("\\boxed{5}", "4", {}).score == -1.0
    assert math_01("\\boxed{4}", "4", {}).score == 1.0
    assert math_01("\\boxed{5}", "4", {}).score == 0.0
    assert math_01("\\boxed{4}", "4", {}).correct and not math_01("\\boxed{5}", "4", {}).correct
    assert get_reward("math_dapo") is math_dapo
    assert get_reward("math_01") is math_01
    assert get_reward("math_equiv") is math_equiv


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
        assert math_equiv(payload, "2", {}).score == -1.0
        assert math_01(payload, "1024", {}).score == 0.0
    assert not marker.exists()


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("\\{}boxed frac $1234567890.,-/%Answer:\n")), max_size=60))
def test_arbitrary_text_never_raises(response: str) -> None:
    for reward in (math_dapo, math_equiv):
        output = reward(response, "1", {})
        assert output.score in (1.0, -1.0)
        assert output.correct is (output.score == 1.0)
