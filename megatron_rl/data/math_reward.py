"""Rule-based math rewards: the final answer of a response against the ground truth.

Two checkers, three registered rewards (``extra_info`` is accepted for the contract and ignored):

- ``math_dapo``: the DAPO rule (below), +1 correct, -1 otherwise;
- ``math_equiv``: the lenient equivalence checker (below), +1 correct, -1 otherwise;
- ``math_01``: the lenient equivalence checker, 1 correct, 0 otherwise.

``math_dapo`` is the reward DAPO trained with, so a DAPO run trains on the paper's signal and
compares with it. Neither checker contains the other: the lenient one accepts a box, ``0.5`` for
``\\frac{1}{2}`` and ``50\\%`` for ``50``, which the DAPO rule rejects; it rejects unit words
(``5 cm`` for ``5``) and answers right only after their last ``=`` (``7 because 3+4=7``), which
the DAPO rule accepts. ``math_01`` keeps the lenient checker it has always used: no shipped recipe names it,
and a 1/0 accuracy should not depend on how a correct number is written.

Neither checker evaluates model output: it is parsed with regular expressions and
``fractions.Fraction`` only.

The DAPO rule (``compute_score`` of the DAPO release, shipped by verl as
``verl/utils/reward_score/math_dapo.py``; the MATH answer normalisation of Minerva and
lm-evaluation-harness):

- Window: only the last 300 characters of the response are read; an answer that starts before
  them is not seen.
- Extraction: the text after the last ``Answer:`` in the window, matched by
  ``(?i)Answer\\s*:\\s*([^\\n]+)``: case-insensitive, any whitespace (newlines too) after the
  colon, then the rest of that line, trailing text included. A ``\\boxed{}`` outside an
  ``Answer:`` line is ignored.
- Normalisation, of the prediction and of the ground truth alike: keep the text after the last
  ``=``; apply fixed substitutions (``"an "``, ``"a "``, ``\\$``, ``"\\ "`` and every space go,
  ``mbox`` -> ``text``, ``\\text{and}`` -> ``,``, ``\\text{m}`` -> ``\\text{}``) then delete a
  fixed list of unit words and decorations (``cm``, ``degrees``, ``dollars``, ``^\\circ``,
  ``\\text{}``, ``\\ldots``...: ``_DAPO_REMOVED``), as plain substring replacements; keep only
  the first ``$...$`` span of a line; unwrap ``\\text{}``, ``\\textbf{}``, ``\\overline{}`` and
  ``\\boxed{}``; ``\\frac12`` -> ``\\frac{1}{2}``, ``\\sqrt2`` -> ``\\sqrt{2}``; drop ``$``;
  drop commas from a string that is then all digits (``1,000`` -> ``1000``); strip.
- Comparison: the two normalised strings must be equal. No numeric equivalence: ``0.5`` is not
  ``\\frac{1}{2}``, ``5.0`` is not ``5``, ``\\dfrac`` is not ``\\frac``, ``50\\%`` is not ``50``.
- Score: +1.0 if equal, else -1.0. The reference also returns ``acc`` (our ``correct``) and the
  normalised prediction (not kept).
- One deliberate difference: without an ``Answer:`` in the window the reference compares the
  placeholder ``[INVALID]``, so a ground truth that normalises to ``[INVALID]`` would be matched
  by any response without an answer; here no answer is always wrong.
- The reference's strict-box mode (``strict_box_verify``, off in DAPO's recipe and in verl's
  dispatch) is ``dapo_is_correct(..., strict_box=True)``: the content of the last ``\\boxed{}``
  in the window's last 100 characters, equal to the raw ground truth, no normalisation.

The lenient checker (``math_equiv``, ``math_01``):

- Extraction: the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``; nested and escaped
  braces are fine; ``\\boxed 5`` takes the next whitespace-delimited token). If the last box is
  unterminated (a truncated response) there is no answer. Without a box, the rest of the line
  after the last ``Answer:`` (case-insensitive) is the answer. The whole response is read.
- Normalisation: drop ``$``, whitespace, ``\\left``/``\\right``, the spacing macros ``\\! \\, \\; \\:``,
  ``^\\circ``, a ``%``/``\\%`` sign (``50\\%`` == ``50``: the sign is dropped, not scaled),
  trailing periods and a leading single-letter assignment (``x=5`` -> ``5``); unwrap
  ``\\text{...}``-like macros; ``\\dfrac``/``\\tfrac`` -> ``\\frac``. A ground truth written as
  ``\\boxed{...}`` is unboxed first.
- Comparison: when both sides parse as numbers (integers, ``1,000``-style thousands separators,
  decimals, signs, ``\\frac{a}{b}``, ``\\frac12``, ``a/b``) they are compared exactly as
  fractions; otherwise the normalised strings must be equal. Unit words are not dropped
  (``5 cm`` is not ``5``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from megatron_rl.data.rewards import RewardOutput, register_reward

_BOX_MACROS = ("\\boxed", "\\fbox")
_TEXT_MACRO = re.compile(r"\\(?:text|textbf|textrm|textit|mathrm|mathbf|mbox)\s*\{")
_ANSWER_LINE = re.compile(r"(?i)\banswer\s*:[ \t]*([^\n]*)")
_DROPPED = re.compile(r"\\left(?![a-zA-Z])|\\right(?![a-zA-Z])|\\[!,;: ]|\^\s*\{?\\circ\}?|\\?%|\$|~")
_ASSIGNMENT = re.compile(r"[a-zA-Z]=(?!=)")
_NUM = r"[+-]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
_NUMBER = re.compile(_NUM)
_LATEX_FRACTION = re.compile(rf"([+-]?)\\frac(?:\{{({_NUM})\}}\{{({_NUM})\}}|(\d)(\d))")
_SLASH_FRACTION = re.compile(rf"({_NUM})/({_NUM})")
_MAX_NUMBER_CHARS = 256


def _closing_brace(text: str, open_index: int) -> int | None:
    """Index of the brace closing ``text[open_index] == '{'``, skipping escaped braces; None if unbalanced."""
    depth = 0
    i = open_index
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed``/``\\fbox`` in ``text``; None if absent or unterminated."""
    start = max(text.rfind(macro) for macro in _BOX_MACROS)
    if start < 0:
        return None
    rest = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if text.startswith("{", rest):
        end = _closing_brace(text, rest)
        return None if end is None else text[rest + 1 : end]
    if rest < len(text) and text[rest] in " \t":
        token = text[rest:].split(None, 1)
        return token[0].split("$", 1)[0] if token else None
    return None


def extract_answer(response: str) -> str | None:
    """The final answer of ``response``: last box, else last ``Answer:`` line; None if neither."""
    boxed = extract_boxed(response)
    if boxed is not None:
        return boxed
    lines: list[str] = _ANSWER_LINE.findall(response)
    if not lines or not lines[-1].strip():
        return None
    return lines[-1].strip()


def _unwrap_text_macros(text: str) -> str:
    while (match := _TEXT_MACRO.search(text)) is not None:
        end = _closing_brace(text, match.end() - 1)
        if end is None:
            return text[: match.start()] + text[match.end() :]
        text = text[: match.start()] + text[match.end() : end] + text[end + 1 :]
    return text


def normalize_answer(answer: str) -> str:
    """Canonical string form of an answer (see the module docstring for the rules)."""
    text = _unwrap_text_macros(answer).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = _DROPPED.sub("", text.replace("\u2212", "-"))
    text = "".join(text.split()).rstrip(".")
    if _ASSIGNMENT.match(text):
        text = text[2:]
    while text.startswith("{") and _closing_brace(text, 0) == len(text) - 1:
        text = text[1:-1]
    return text


def parse_number(text: str) -> Fraction | None:
    """Exact value of a normalised numeric answer, or None if it is not a plain number."""
    if len(text) > _MAX_NUMBER_CHARS:
        return None
    try:
        if _NUMBER.fullmatch(text):
            return _plain_number(text)
        if (match := _LATEX_FRACTION.fullmatch(text)) is not None:
            sign, numerator, denominator, short_num, short_den = match.groups()
            value = _plain_number(numerator or short_num) / _plain_number(denominator or short_den)
            return -value if sign == "-" else value
        if (match := _SLASH_FRACTION.fullmatch(text)) is not None:
            return _plain_number(match.group(1)) / _plain_number(match.group(2))
    except ZeroDivisionError:
        return None
    return None


def _plain_number(text: str) -> Fraction:
    """Exact value of ``text``, which matches ``_NUM`` whole (thousands commas allowed)."""
    return Fraction(text.replace(",", ""))


def math_answer(response: str) -> str | None:
    """The lenient checker's normal form of ``response``'s final answer: a plain number as its exact value
    (``0.5``, ``\\frac{1}{2}`` and ``1/2`` all give ``1/2``), else the normalised text; None without an answer."""
    predicted = extract_answer(response)
    text = None if predicted is None else normalize_answer(predicted)
    if not text:
        return None
    value = parse_number(text)
    return text if value is None else str(value)


def answers_match(predicted: str, ground_truth: str) -> bool:
    """Whether two answer strings are equal after normalisation (numbers compared exactly)."""
    left, right = normalize_answer(predicted), normalize_answer(ground_truth)
    if not left or not right:
        return False
    left_value, right_value = parse_number(left), parse_number(right)
    if left_value is not None and right_value is not None:
        return left_value == right_value
    return left == right


def is_correct_math_response(response: str, ground_truth: str) -> bool:
    """Whether the final answer extracted from ``response`` matches ``ground_truth``.

    A ground truth written as ``\\boxed{...}`` is unboxed first. No extractable answer is wrong.
    """
    predicted = extract_answer(response)
    if predicted is None:
        return False
    return answers_match(predicted, extract_boxed(ground_truth) or ground_truth)


# --- The DAPO rule -------------------------------------------------------------------------

DAPO_WINDOW_CHARS = 300
"""Characters at the end of a response the DAPO rule reads (MATH-500's longest answer is 159)."""

DAPO_STRICT_BOX_CHARS = 100
"""Characters at the end of the window that strict-box mode searches for the last box."""

_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# Plain substring replacements, applied in this order (the order matters: spaces go before
# ``\text{m}`` is looked for, so ``\text{ m}`` is caught too).
_DAPO_SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)

# Deleted wherever they occur, after the substitutions, in this order (a unit word goes from
# inside a longer word too: ``"centimeters"`` loses ``"meters"``).
_DAPO_REMOVED = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)

# Then regex rewrites, in this order. "." stops at a newline, so a multi-line ground truth is
# rewritten line by line.
_DAPO_REWRITES = (
    (re.compile(r".*?\$(.*?)\$.*"), r"$\1$"),  # keep only a line's first $...$ span
    (re.compile(r"\\text\{(.*?)\}"), r"\1"),
    (re.compile(r"\\textbf\{(.*?)\}"), r"\1"),
    (re.compile(r"\\overline\{(.*?)\}"), r"\1"),
    (re.compile(r"\\boxed\{(.*)\}"), r"\1"),  # greedy: up to the line's last brace
    (re.compile(r"frac([^{])(.)"), r"frac{\1}{\2}"),  # \frac12 -> \frac{1}{2}
    (re.compile(r"sqrt([^{])"), r"sqrt{\1}"),  # \sqrt2 -> \sqrt{2}
)


def dapo_extract_answer(response: str) -> str | None:
    """The raw DAPO answer: the rest of the line after the last ``Answer:`` in the window, or None."""
    matches = _DAPO_ANSWER.findall(response[-DAPO_WINDOW_CHARS:])
    return matches[-1] if matches else None


def dapo_normalize(answer: str) -> str:
    """DAPO's normal form of an answer (the prediction's and the ground truth's alike)."""
    text = answer.split("=")[-1]
    for before, after in _DAPO_SUBSTITUTIONS:
        text = text.replace(before, after)
    for removed in _DAPO_REMOVED:
        text = text.replace(removed, "")
    for pattern, replacement in _DAPO_REWRITES:
        text = pattern.sub(replacement, text)
    text = text.replace("$", "")
    # str.isdigit, as the reference: superscript and non-ASCII digits count as digits.
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def _dapo_last_box(text: str) -> str | None:
    """Content of the last ``\\boxed{`` in ``text``, braces counted without escapes; None if absent or open."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for index in range(start, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[start + len("\\boxed{") : index]
    return None


def dapo_is_correct(response: str, ground_truth: str, *, strict_box: bool = False) -> bool:
    """Whether ``response`` is correct by the DAPO rule (see the module docstring).

    ``strict_box`` selects the reference's strict-box mode: the last ``\\boxed{}`` among the
    window's last ``DAPO_STRICT_BOX_CHARS`` characters must equal ``ground_truth`` as written.
    """
    window = response[-DAPO_WINDOW_CHARS:]
    if strict_box:
        return _dapo_last_box(window[-DAPO_STRICT_BOX_CHARS:]) == ground_truth
    answer = dapo_extract_answer(window)
    return answer is not None and dapo_normalize(answer) == dapo_normalize(ground_truth)


# --- Registered rewards ----------------------------------------------------------------------


@register_reward("math_dapo")
def math_dapo(response: str, ground_truth: str, extra_info: Mapping[str, Any]) -> RewardOutput:
    """+1.0 if ``response`` is correct by the DAPO rule, else -1.0 (DAPO's reward); the answer in DAPO's normal form."""
    correct = dapo_is_correct(response, ground_truth)
    extracted = dapo_extract_answer(response)
    answer = None if extracted is None else dapo_normalize(extracted)
    return RewardOutput(score=1.0 if correct else -1.0, correct=correct, answer=answer)


@register_reward("math_equiv")
def math_equiv(response: str, ground_truth: str, extra_info: Mapping[str, Any]) -> RewardOutput:
    """+1.0 if the response's final answer is equivalent to ``ground_truth`` (lenient checker), else -1.0."""
    correct = is_correct_math_response(response, ground_truth)
    return RewardOutput(score=1.0 if correct else -1.0, correct=correct, answer=math_answer(response))


@register_reward("math_01")
def math_01(response: str, ground_truth: str, extra_info: Mapping[str, Any]) -> RewardOutput:
    """1.0 if the response's final answer is equivalent to ``ground_truth`` (lenient checker), else 0.0."""
    correct = is_correct_math_response(response, ground_truth)
    return RewardOutput(score=1.0 if correct else 0.0, correct=correct, answer=math_answer(response))
