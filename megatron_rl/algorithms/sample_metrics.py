"""Evaluation metrics over n sampled responses per prompt: mean@n, pass@k and maj@k.

Papers report them at a fixed n per prompt: pass@k is the unbiased estimator of
Chen et al. 2021 (arXiv 2107.03374, section 2.1), maj@k the same kind of
estimator for majority voting (self-consistency, arXiv 2203.11171): both are
exact expectations over the C(n, k) subsets of k responses drawn without
replacement from the n, computed by counting, never by enumerating subsets.

Every value is an exact rational rounded to float once (Python's int / int and
float(Fraction) are correctly rounded), so it is within half an ulp of the
exact expectation. Pure Python: no torch needed.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from fractions import Fraction
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that k of the n responses, drawn without replacement, include a correct one.

    The unbiased estimator 1 - C(n - c, k) / C(n, k), computed with exact
    integers and rounded once: exact for any n (thousands take microseconds).
    pass@1 is c / n; pass@n is 1 when c > 0; pass@k is 0 when c = 0.

    Args:
        n: responses sampled for the prompt, >= 1.
        c: how many of them are correct, 0 <= c <= n.
        k: subset size, 1 <= k <= n.

    Raises:
        ValueError: ``n``, ``c`` or ``k`` out of range.
    """
    return float(_pass_at_k_exact(n, c, k))


def majority_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
    """Expected correctness of the majority answer of k responses drawn without replacement.

    The expectation is exact, over all C(n, k) subsets of the n responses,
    each equally likely. The vote of one subset:

    * responses with the same answer string vote together for it;
    * a response whose answer is None (none extracted) casts no vote;
    * the answer with the most votes wins; a tie between t answers is broken
      uniformly at random, so the subset scores the mean correctness of the t;
    * a subset with no votes at all (only None answers) scores 0;
    * an answer's correctness is the mean of ``correct`` over all n responses
      that gave it (0 or 1 when the reward depends on the answer only).

    So maj@1 is the mean over the n responses of ``correct`` where the answer
    is not None and 0 where it is; maj@n is the vote of the whole set.

    Subsets are counted, not enumerated: for each vote count j, a polynomial
    product over the answer classes counts the draws of s votes in which no
    class gets more than j and t classes get exactly j; dividing one class of
    size m out of it counts the draws of that class's rivals, and None
    responses fill the subset up to k. That is O(n k^3) operations on Python
    ints at most: tens of milliseconds for n = k = 64 on every mix of class
    sizes tried.

    Args:
        answers: [n] extracted answers, None where there is none.
        correct: [n] whether each response was judged correct.
        k: subset size, 1 <= k <= n.

    Raises:
        ValueError: ``answers`` empty or of another length than ``correct``;
            ``k`` out of range.
    """
    return float(_majority_at_k_exact(answers, correct, k))


def metrics_at_k(responses: Sequence[Sequence[tuple[str | None, bool]]], ks: Sequence[int]) -> dict[str, float]:
    """mean@n, pass@k and maj@k of a validation set, each the mean over its prompts.

    Args:
        responses: per prompt, the (answer, correct) pair of each of its n
            responses; every prompt has the same n >= 1 (papers report at a
            fixed n). Answers follow ``majority_at_k``'s rules; pass@k counts
            ``correct`` whatever the answer.
        ks: subset sizes, each 1 <= k <= n; may be empty.

    Returns:
        ``mean@{n}`` (the fraction of correct responses, which pass@1 equals
        exactly) and, for each k, ``pass@{k}`` and ``maj@{k}``. Each value is
        the exact mean over prompts, rounded once.

    Raises:
        ValueError: no prompts, a prompt with no responses, prompts of
            different n, or a k out of range.
    """
    if not responses:
        raise ValueError("responses must hold at least one prompt's responses; got none")
    sizes = sorted({len(prompt) for prompt in responses})
    if len(sizes) > 1:
        raise ValueError(
            f"every prompt must have the same number of responses n; got n in {sizes}: sample the same n per prompt"
        )
    (n,) = sizes
    if n == 0:
        raise ValueError("each prompt must have at least one response; got prompts with n=0")
    for k in ks:
        _check_k(k, n)
    answers = [[answer for answer, _ in prompt] for prompt in responses]
    correct = [[bool(right) for _, right in prompt] for prompt in responses]
    prompts = len(responses)
    metrics = {f"mean@{n}": float(Fraction(sum(map(sum, correct)), n * prompts))}
    for k in ks:
        metrics[f"pass@{k}"] = float(sum(_pass_at_k_exact(n, sum(right), k) for right in correct) / prompts)
        metrics[f"maj@{k}"] = float(
            sum(_majority_at_k_exact(ans, right, k) for ans, right in zip(answers, correct, strict=True)) / prompts
        )
    return metrics


def _check_k(k: int, n: int) -> None:
    if not 1 <= k <= n:
        raise ValueError(
            f"k must be in [1, n={n}] (a subset of the n responses per prompt); got k={k}: sample more responses or drop this k"
        )


def _pass_at_k_exact(n: int, c: int, k: int) -> Fraction:
    if n < 1:
        raise ValueError(f"n must be >= 1 response; got n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"c must be in [0, n={n}] (correct responses among the n); got c={c}")
    _check_k(k, n)
    total = comb(n, k)
    return Fraction(total - comb(n - c, k), total)


def _majority_at_k_exact(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> Fraction:
    n = len(answers)
    if n == 0:
        raise ValueError("answers must hold at least one response; got none")
    if len(correct) != n:
        raise ValueError(
            f"answers and correct must have the same length, one flag per response; got {n} and {len(correct)}"
        )
    _check_k(k, n)
    votes = Counter(answer for answer in answers if answer is not None)
    right = Counter(answer for answer, ok in zip(answers, correct, strict=True) if answer is not None and ok)
    abstained = n - votes.total()
    # Classes of the same size are interchangeable: count each size once.
    classes_of_size = Counter(votes.values())
    right_of_size: defaultdict[int, int] = defaultdict(int)
    for answer, m in votes.items():
        right_of_size[m] += right[answer]

    # subsets[m][t]: summed over the classes of size m, the subsets in which the class wins tied with t others.
    subsets: defaultdict[int, defaultdict[int, int]] = defaultdict(lambda: defaultdict(int))
    for j in range(1, min(max(votes.values(), default=0), k) + 1):
        everyone = _ways_at_most(classes_of_size, j, k - j)
        for m, right_m in right_of_size.items():
            if m < j or right_m == 0:
                continue
            for (s, ties), ways in _without_class(everyone, m, j).items():
                subsets[m][ties] += comb(m, j) * ways * comb(abstained, k - j - s)
    # Summed over the classes of size m, the mean correctness of their answers is right_m / m.
    expected = sum(
        (
            Fraction(right_of_size[m] * count, m * (ties + 1))
            for m, by_ties in subsets.items()
            for ties, count in by_ties.items()
        ),
        start=Fraction(0),
    )
    return expected / comb(n, k)


def _ways_at_most(class_sizes: Counter[int], j: int, budget: int) -> dict[tuple[int, int], int]:
    """Ways to draw s <= budget votes from the classes, none getting more than j, t of them exactly j.

    ``class_sizes`` maps a class size to how many classes have it. Returns
    {(s, t): ways}, the coefficients of the product over the classes of
    sum_{i < j} C(size, i) y^i + C(size, j) x y^j, truncated after y^budget.
    """
    ways = {(0, 0): 1}
    for size, count in class_sizes.items():
        draws = [comb(size, i) for i in range(min(size, j) + 1)]
        for _ in range(count):
            grown: defaultdict[tuple[int, int], int] = defaultdict(int)
            for (s, ties), w in ways.items():
                for i, d in enumerate(draws[: budget - s + 1]):
                    grown[s + i, ties + (i == j)] += w * d
            ways = grown
    return ways


def _without_class(ways: dict[tuple[int, int], int], size: int, j: int) -> dict[tuple[int, int], int]:
    """``_ways_at_most``'s count with one class of ``size`` >= j left out.

    Divides the product by that class's factor, whose constant term is 1, so
    the quotient is exact in integers, solved in increasing s. All terms are
    non-negative and the factor has a constant term, so the quotient's
    support lies within the product's: only its keys are solved for.
    """
    draws = [comb(size, i) for i in range(j + 1)]
    quotient: dict[tuple[int, int], int] = {}
    for s, ties in sorted(ways):
        rest = ways[s, ties] - draws[j] * quotient.get((s - j, ties - 1), 0)
        for i in range(1, min(j - 1, s) + 1):
            rest -= draws[i] * quotient.get((s - i, ties), 0)
        if rest:
            quotient[s, ties] = rest
    return quotient
