"""The ``calculator`` tool: exact rational arithmetic on one expression, parsed with :mod:`ast` (never evaluated as code).

Arguments: ``{"expression": "<arithmetic>"}``. Allowed: integer and decimal literals (``3``, ``0.1``,
``1e-3``, ``1_000``), ``+ - * / // % **``, unary ``+``/``-`` and parentheses, with Python's precedence
(``-2**2`` is -4, ``2**3**2`` is 512). Every value is a :class:`fractions.Fraction`, so ``0.1 + 0.2`` is
exactly ``3/10``. The result prints as an integer when whole (``4``), as an exact decimal when it has
a finite one of at most ``MAX_DECIMAL_PLACES`` places (its reduced denominator has no prime factor but 2
and 5: ``0.3``, ``-2.5``), else as a reduced fraction (``1/3``, ``-22/7``).

Refused with ValueError, whose message the model reads: anything else (names, calls, attributes,
strings, comparisons, ...; the message names the construct), a division or modulo by zero, a
non-integer exponent, an exponent beyond ±``MAX_EXPONENT``, any value (literal, intermediate or result)
whose numerator or denominator would exceed ``MAX_DIGITS`` decimal digits, and an expression longer
than ``MAX_EXPRESSION_CHARS`` or nested too deeply to parse. The bounds keep a call's time and memory small.
"""

from __future__ import annotations

import ast
import decimal
import math
import operator
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

from megatron_rl.tools.registry import register_tool

MAX_EXPONENT = 1000
"""The largest absolute exponent ``**`` accepts."""
MAX_DIGITS = 4300
"""The most decimal digits of a value's numerator or denominator: Python's default limit of int-to-str
conversion (``sys.int_info.default_max_str_digits``), so every accepted result prints."""
MAX_DECIMAL_PLACES = 50
"""The most places of a result printed as a decimal; a longer one prints as a fraction."""
MAX_EXPRESSION_CHARS = 10_000
"""The longest expression accepted."""

_BINARY: dict[type[ast.operator], tuple[str, Callable[[Fraction, Fraction], Fraction]]] = {
    ast.Add: ("+", operator.add),
    ast.Sub: ("-", operator.sub),
    ast.Mult: ("*", operator.mul),
    ast.Div: ("/", operator.truediv),
    ast.FloorDiv: ("//", lambda a, b: Fraction(a // b)),
    ast.Mod: ("%", operator.mod),
}
_LOG10_2 = math.log10(2)
_DIGITS_LIMIT = 10**MAX_DIGITS


@register_tool("calculator")
def calculator(arguments: Mapping[str, Any], context: Mapping[str, Any]) -> str:
    """The value of ``arguments["expression"]`` (see the module docstring); ``context`` is not used."""
    if set(arguments) != {"expression"} or not isinstance(arguments["expression"], str):
        raise ValueError(f'calculator takes {{"expression": "<arithmetic>"}}, got arguments {dict(arguments)!r}')
    return format_number(evaluate(arguments["expression"]))


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic ``expression``; ValueError for anything refused (module docstring)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression has {len(expression)} characters; the most is {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        return _value(tree.body, expression.strip())
    except SyntaxError as exc:
        raise ValueError(f"cannot parse {expression[:200]!r}: {exc.msg}") from exc
    except RecursionError as exc:
        raise ValueError("the expression nests too deeply") from exc


def format_number(value: Fraction) -> str:
    """``value`` as an integer, an exact decimal, or a reduced fraction ``p/q`` (the module docstring's rule)."""
    if value.denominator == 1:
        return str(value.numerator)
    twos, fives = _multiplicity(value.denominator, 2), _multiplicity(value.denominator, 5)
    places = max(twos, fives)
    if value.denominator != 2**twos * 5**fives or places > MAX_DECIMAL_PLACES:
        return f"{value.numerator}/{value.denominator}"
    digits = str(abs(value.numerator) * 10**places // value.denominator).rjust(places + 1, "0")
    sign = "-" if value < 0 else ""
    return f"{sign}{digits[:-places]}.{digits[-places:]}"


def _multiplicity(number: int, prime: int) -> int:
    count = 0
    while number % prime == 0:
        number //= prime
        count += 1
    return count


def _value(node: ast.expr, source: str) -> Fraction:
    """The value of one node of the parsed expression (``source``, for literals' exact text)."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(_literal(node, source), "the literal")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        operand = _value(node.operand, source)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        return _power(_value(node.left, source), _value(node.right, source))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        symbol, apply = _BINARY[type(node.op)]
        left, right = _value(node.left, source), _value(node.right, source)
        if right == 0 and symbol in ("/", "//", "%"):
            raise ValueError(f"division by zero: {format_number(left)} {symbol} 0")
        return _bounded(apply(left, right), f"the result of {symbol}")
    raise ValueError(f"{_describe(node)} is not allowed; use numbers, + - * / // % **, unary +/- and parentheses")


def _literal(node: ast.Constant, source: str) -> Fraction:
    """The exact value of a number literal, read from its text (a float's binary value would be inexact)."""
    if isinstance(node.value, int):
        return Fraction(node.value)
    text = ast.get_source_segment(source, node) or repr(node.value)
    number = decimal.Decimal(text.replace("_", ""))
    # Checked before Fraction expands the exponent: 1e999999999 would need a billion digits.
    if abs(number.adjusted()) > MAX_DIGITS:
        raise ValueError(f"the literal {text} has more than {MAX_DIGITS} digits")
    return Fraction(number)


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise ValueError(f"the exponent {format_number(exponent)} is not an integer (the result may be irrational)")
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"the exponent {exponent} is beyond ±{MAX_EXPONENT}")
    if base == 0 and exponent < 0:
        raise ValueError(f"division by zero: 0 ** {exponent}")
    # Estimated before computing: the digits of p**n are about n times those of p.
    bits = max(base.numerator.bit_length(), base.denominator.bit_length()) * abs(int(exponent))
    if bits * _LOG10_2 > MAX_DIGITS + 1:
        raise ValueError(f"the result of ** has more than {MAX_DIGITS} digits")
    return _bounded(base ** int(exponent), "the result of **")


def _bounded(value: Fraction, what: str) -> Fraction:
    """``value`` unless its numerator or denominator has more than ``MAX_DIGITS`` digits (ValueError)."""
    if abs(value.numerator) >= _DIGITS_LIMIT or value.denominator >= _DIGITS_LIMIT:
        raise ValueError(f"{what} has more than {MAX_DIGITS} digits")
    return value


def _describe(node: ast.AST) -> str:
    """What a refused node is, in words, for the message."""
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    if isinstance(node, ast.Call):
        return "a function call"
    if isinstance(node, ast.Attribute):
        return f"the attribute {node.attr!r}"
    if isinstance(node, ast.Constant):
        return f"the {type(node.value).__name__} constant {node.value!r}"
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        return f"the operator {type(node.op).__name__}"
    return f"a {type(node).__name__} expression"
