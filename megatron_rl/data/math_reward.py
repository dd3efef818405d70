"""Rule-based math rewards: the final answer of a response against the ground truth.

Registered rewards (``extra_info`` is accepted for the contract and ignored):

- ``math_dapo``: +1 correct, -1 otherwise (DAPO's rule-based reward);
- ``math_01``: 1 correct, 0 otherwise.

Pure string processing: model output is parsed with regular expressions and
``fractions.Fraction``, never evaluated. Rules:

- Extraction: the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``; nested and escaped
  braces are fine; ``\\boxed 5`` takes the next whitespace-delimited token). If the last box is
  unterminated (a truncated response) there is no answer. Without a box, the rest of the line
  after the last ``Answer:`` (case-insensitive) is the answer.
- Normalisation: drop ``$``, whitespace, ``\\left``/``\\right``, the spacing macros ``\\! \\, \\; \\:``,
  ``^\\circ``, a ``%``/``\\%`` sign (``50\\%`` == ``50``: the sign is dropped, not scaled),
  trailing periods and a leading single-letter assignment (``x=5`` -> ``5``); unwrap
  ``\\text{...}``-like macros; ``\\dfrac``/``\\tfrac`` -> ``\\frac``.
- Comparison: when both sides parse as numbers (integers, ``1,000``-style thousands separators,
  decimals, signs, ``\\frac{a}{b}``, ``\\frac12``, ``a/b``) they are compared exactly as
  fractions; otherwise the normalised strings must be equal.
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
    lines = _ANSWER_LINE.findall(response)
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
            return Fraction(text.replace(",", ""))
        if (match := _LATEX_FRACTION.fullmatch(text)) is not None:
            sign, numerator, denominator, short_num, short_den = match.groups()
            value = parse_number(numerator or short_num) / parse_number(denominator or short_den)
            return -value if sign == "-" else value
        if (match := _SLASH_FRACTION.fullmatch(text)) is not None:
            return parse_number(match.group(1)) / parse_number(match.group(2))
    except ZeroDivisionError:
        return None
    return None


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


@register_reward("math_dapo")
def math_dapo(response: str, ground_truth: str, extra_info: Mapping[str, Any]) -> RewardOutput:
    """+1.0 if the response's final answer equals ``ground_truth``, else -1.0."""
    correct = is_correct_math_response(response, ground_truth)
    return RewardOutput(score=1.0 if correct else -1.0, correct=correct)


@register_reward("math_01")
def math_01(response: str, ground_truth: str, extra_info: Mapping[str, Any]) -> RewardOutput:
    """1.0 if the response's final answer equals ``ground_truth``, else 0.0."""
    correct = is_correct_math_response(response, ground_truth)
    return RewardOutput(score=1.0 if correct else 0.0, correct=correct)
