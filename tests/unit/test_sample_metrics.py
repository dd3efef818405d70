"""pass@k, maj@k and mean@n against brute force over every k-subset, in exact Fraction arithmetic.

The tolerance is none: each function computes the exact rational and rounds it
to float once (int / int and float(Fraction) are correctly rounded), so its
result must equal float() of the brute-force Fraction bit for bit, which is
within half an ulp (a relative 2**-53) of the exact expectation. A float
tolerance of a few ulps would be the bound for a product or sum of floats;
this code does no float arithmetic before that one rounding.
"""

from __future__ import annotations

import random
from collections import Counter
from fractions import Fraction
from itertools import combinations
from math import comb, prod

import pytest

from megatron_rl.algorithms import majority_at_k, metrics_at_k, pass_at_k


def brute_pass_at_k(n: int, c: int, k: int) -> Fraction:
    correct = [i < c for i in range(n)]
    subsets = list(combinations(range(n), k))
    return Fraction(sum(any(correct[i] for i in subset) for subset in subsets), len(subsets))


def brute_majority_at_k(answers: list[str | None], correct: list[bool], k: int) -> Fraction:
    quality = {
        answer: Fraction(sum(ok for a, ok in zip(answers, correct, strict=True) if a == answer), answers.count(answer))
        for answer in set(answers) - {None}
    }
    subsets = list(combinations(range(len(answers)), k))
    total = Fraction(0)
    for subset in subsets:
        tally = Counter(answers[i] for i in subset if answers[i] is not None)
        if tally:
            top = max(tally.values())
            winners = [answer for answer, votes in tally.items() if votes == top]
            total += Fraction(sum(quality[answer] for answer in winners), len(winners))
    return total / len(subsets)


def random_fixture(rng: random.Random) -> tuple[list[str | None], list[bool]]:
    """n <= 9 responses over a few answers and None; correctness set per answer, or per response (mixed classes)."""
    n = rng.randint(1, 9)
    pool: list[str | None] = list("abcde"[: rng.randint(1, 5)])
    if rng.random() < 0.7:
        pool.append(None)
    answers = [rng.choice(pool) for _ in range(n)]
    if rng.random() < 0.5:
        right = {answer: rng.random() < 0.5 for answer in pool}
        correct = [right[answer] for answer in answers]
    else:
        correct = [rng.random() < 0.5 for _ in answers]
    return answers, correct


def test_pass_at_k_equals_brute_force_for_every_n_c_k_up_to_8() -> None:
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == float(brute_pass_at_k(n, c, k)), (n, c, k)


def test_pass_at_1_is_c_over_n_and_pass_at_n_is_whether_any_is_correct() -> None:
    for n in range(1, 40):
        for c in range(n + 1):
            assert pass_at_k(n, c, 1) == c / n
            assert pass_at_k(n, c, n) == (1.0 if c > 0 else 0.0)


@pytest.mark.parametrize(("n", "c", "k"), [(1024, 1, 1), (2000, 3, 100), (5000, 17, 2500), (5000, 4990, 7)])
def test_pass_at_k_for_thousands_of_responses_matches_the_product_form(n: int, c: int, k: int) -> None:
    # Chen et al.'s stable form, a product of floats: a relative error of about (c + 1) ulps.
    product_form = 1.0 - prod(1.0 - k / i for i in range(n - c + 1, n + 1))
    assert pass_at_k(n, c, k) == pytest.approx(product_form, rel=1e-12)


@pytest.mark.parametrize(
    ("n", "c", "k", "message"),
    [
        (0, 0, 1, "n must be"),
        (4, -1, 2, "c must be"),
        (4, 5, 2, "c must be"),
        (4, 2, 0, "k must be"),
        (4, 2, 5, "k must be"),
    ],
)
def test_pass_at_k_refuses_out_of_range_arguments(n: int, c: int, k: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pass_at_k(n, c, k)


def test_majority_at_k_equals_brute_force_on_random_fixtures_for_every_k() -> None:
    rng = random.Random(20210707)
    for _ in range(300):
        answers, correct = random_fixture(rng)
        for k in range(1, len(answers) + 1):
            expected = float(brute_majority_at_k(answers, correct, k))
            assert majority_at_k(answers, correct, k) == expected, (answers, correct, k)


def test_majority_at_k_by_hand() -> None:
    # Subsets of 2 of [a+, b-, b-]: {a, b} twice, a tie scoring 1/2; {b, b} once, scoring 0.
    assert majority_at_k(["a", "b", "b"], [True, False, False], 2) == 1 / 3
    # A 2-2 tie between a right and a wrong answer; the None response does not vote.
    assert majority_at_k(["a", "a", "b", "b", None], [True, True, False, False, True], 5) == 0.5
    # No votes at all scores 0, even when the responses are judged correct.
    assert majority_at_k([None, None, None], [True, True, True], 2) == 0.0
    # Mixed correctness within a class: the answer is worth its mean, 1/3.
    assert majority_at_k(["a", "a", "a", "b"], [True, False, False, True], 4) == 1 / 3


def test_majority_at_1_is_the_mean_of_correct_over_answered_responses() -> None:
    rng = random.Random(1)
    for _ in range(100):
        answers, correct = random_fixture(rng)
        answered_right = sum(ok for answer, ok in zip(answers, correct, strict=True) if answer is not None)
        assert majority_at_k(answers, correct, 1) == answered_right / len(answers)


def test_majority_at_n_is_the_vote_of_the_whole_set() -> None:
    rng = random.Random(2)
    for _ in range(100):
        answers, correct = random_fixture(rng)
        tally = Counter(answer for answer in answers if answer is not None)
        if not tally:
            assert majority_at_k(answers, correct, len(answers)) == 0.0
            continue
        winners = [answer for answer, votes in tally.items() if votes == max(tally.values())]
        worth = [Fraction(sum(ok for a, ok in zip(answers, correct, strict=True) if a == w), tally[w]) for w in winners]
        assert majority_at_k(answers, correct, len(answers)) == float(sum(worth, Fraction(0)) / len(winners))


@pytest.mark.parametrize("k", [1, 2, 7, 32, 63, 64])
def test_majority_at_k_at_n_64_in_closed_form(k: int) -> None:
    rng = random.Random(k)
    correct = [rng.random() < 0.3 for _ in range(64)]
    # 64 distinct answers: every subset is a k-way tie, worth the mean correctness of its k responses.
    assert majority_at_k([str(i) for i in range(64)], correct, k) == sum(correct) / 64
    # One answer: every subset elects it.
    assert majority_at_k(["x"] * 64, [True] * 13 + [False] * 51, k) == 13 / 64
    # Two answers of 32 each, one right: swapping them maps subsets one-to-one, so each wins half the time.
    assert majority_at_k(["r"] * 32 + ["w"] * 32, [True] * 32 + [False] * 32, k) == 0.5
    # A right answer given 30 times against 34 None: it wins whenever it is drawn.
    assert majority_at_k(["r"] * 30 + [None] * 34, [True] * 64, k) == 1 - comb(34, k) / comb(64, k)


@pytest.mark.parametrize(
    ("answers", "correct", "k", "message"),
    [
        ([], [], 1, "answers must hold"),
        (["a", "b"], [True], 1, "same length"),
        (["a", "b"], [True, False], 0, "k must be"),
        (["a", "b"], [True, False], 3, "k must be"),
    ],
)
def test_majority_at_k_refuses_bad_arguments(
    answers: list[str | None], correct: list[bool], k: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        majority_at_k(answers, correct, k)


def test_metrics_at_k_averages_over_prompts_and_pass_at_1_is_mean_at_n() -> None:
    rng = random.Random(3)
    prompts = []
    for _ in range(25):
        answers = [rng.choice(["1", "2", "3", None]) for _ in range(6)]
        correct = [answer == "1" or rng.random() < 0.1 for answer in answers]
        prompts.append(list(zip(answers, correct, strict=True)))
    metrics = metrics_at_k(prompts, [1, 2, 6])
    assert list(metrics) == ["mean@6", "pass@1", "maj@1", "pass@2", "maj@2", "pass@6", "maj@6"]
    assert metrics["pass@1"] == metrics["mean@6"] == sum(ok for prompt in prompts for _, ok in prompt) / (6 * 25)
    for k in (1, 2, 6):
        pass_k = sum(brute_pass_at_k(6, sum(ok for _, ok in prompt), k) for prompt in prompts) / len(prompts)
        maj_k = sum(
            brute_majority_at_k([a for a, _ in prompt], [ok for _, ok in prompt], k) for prompt in prompts
        ) / len(prompts)
        assert metrics[f"pass@{k}"] == float(pass_k)
        assert metrics[f"maj@{k}"] == float(maj_k)


def test_metrics_at_k_with_no_ks_is_mean_at_n_alone() -> None:
    assert metrics_at_k([[("a", True), (None, False)], [("b", False), ("b", False)]], []) == {"mean@2": 0.25}


@pytest.mark.parametrize(
    ("responses", "ks", "message"),
    [
        ([], [1], "at least one prompt"),
        ([[]], [1], "at least one response"),
        ([[("a", True)], [("a", True), ("b", False)]], [1], r"same number of responses n; got n in \[1, 2\]"),
        ([[("a", True), ("b", False)]], [3], r"k must be in \[1, n=2\].*got k=3"),
        ([[("a", True), ("b", False)]], [0], "k must be"),
    ],
)
def test_metrics_at_k_refuses_bad_sets_and_ks(
    responses: list[list[tuple[str | None, bool]]], ks: list[int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        metrics_at_k(responses, ks)
