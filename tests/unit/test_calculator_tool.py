"""The calculator tool: exact arithmetic with Python's precedence, printed exactly; everything else refused."""

from __future__ import annotations

from fractions import Fraction

import pytest

from megatron_rl.tools.calculator import MAX_DIGITS, calculator, evaluate, format_number


def _calc(expression: str) -> str:
    return calculator({"expression": expression}, {})


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("2 + 3 * 4", "14"),
        ("(2 + 3) * 4", "20"),
        ("10 - 4 - 3", "3"),  # left-associative
        ("2 ** 3 ** 2", "512"),  # right-associative
        ("-2 ** 2", "-4"),  # ** binds tighter than unary minus
        ("(-2) ** 2", "4"),
        ("2 ** -2", "0.25"),
        ("--3", "3"),
        ("+-+3", "-3"),
        ("7 / 2", "3.5"),
        ("-7 / 2", "-3.5"),
        ("1 / 3", "1/3"),
        ("-22 / 7", "-22/7"),
        ("1/3 + 1/6", "0.5"),
        ("1/3 * 3", "1"),
        ("0.1 + 0.2", "0.3"),  # exact, not binary floating point
        ("0.1 * 3", "0.3"),
        ("1e3 + 1_000", "2000"),
        ("2.5e-3", "0.0025"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),  # floor, as in Python
        ("7 % 3", "1"),
        ("-7 % 3", "2"),
        ("7.5 // 2", "3"),
        ("7.5 % 2", "1.5"),
        ("0x10 + 0b11 + 0o7", "26"),
        ("2 ** 100", str(2**100)),
        ("(1/2) ** 10", "0.0009765625"),
        ("1 / 2 ** 60", "1/1152921504606846976"),  # a finite decimal of 60 places prints as a fraction
        ("3 ** 0", "1"),
        ("0 ** 0", "1"),
        (" ( 1 + 2 ) ", "3"),
        ("12345678901234567890 * 98765432109876543210", str(12345678901234567890 * 98765432109876543210)),
    ],
)
def test_expressions(expression: str, expected: str) -> None:
    assert _calc(expression) == expected


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("x + 1", "the name 'x' is not allowed; use numbers"),
        ("abs(-1)", "a function call is not allowed"),
        ("__import__('os').system('true')", "a function call is not allowed"),
        ("(1).real", "the attribute 'real' is not allowed"),
        ("'a' * 3", "the str constant 'a' is not allowed"),
        ("True + 1", "the bool constant True is not allowed"),
        ("1j * 2", "the complex constant 1j is not allowed"),
        ("1 < 2", "a Compare expression is not allowed"),
        ("[1, 2]", "a List expression is not allowed"),
        ("lambda: 1", "a Lambda expression is not allowed"),
        ("~1", "the operator Invert is not allowed"),
        ("1 << 3", "the operator LShift is not allowed"),
        ("1 +", "cannot parse '1 \\+': invalid syntax"),
        ("1; 2", "cannot parse '1; 2': invalid syntax"),
        ("1 / 0", "division by zero: 1 / 0"),
        ("1 // (2 - 2)", "division by zero: 1 // 0"),
        ("5 % 0.0", "division by zero: 5 % 0"),
        ("0 ** -1", "division by zero: 0 \\*\\* -1"),
        ("2 ** 0.5", "the exponent 0.5 is not an integer"),
        ("2 ** 1001", "the exponent 1001 is beyond ±1000"),
        ("2 ** -1001", "the exponent -1001 is beyond ±1000"),
        ("2 ** 10 ** 10", "the exponent 10000000000 is beyond ±1000"),
        ("(10 ** 1000) ** 5", f"has more than {MAX_DIGITS} digits"),
        ("10 ** 1000 * 10 ** 1000 * 10 ** 1000 * 10 ** 1000 * 10 ** 1000", f"has more than {MAX_DIGITS} digits"),
        ("1e999999999", f"the literal 1e999999999 has more than {MAX_DIGITS} digits"),
        ("1" * 5000, "cannot parse '1111.*Exceeds the limit \\(4300 digits\\)"),
        ("-" * 5000 + "1", "the expression nests too deeply"),
        ("1" + "+1" * 2000, "the expression nests too deeply"),
        ("(" * 300 + "1" + ")" * 300, "too many nested parentheses"),
    ],
)
def test_refusals_name_what_is_not_allowed(expression: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _calc(expression)


def test_limits_of_digits_are_exact() -> None:
    assert len(_calc("10 ** 1000 * 10 ** 1000 * 10 ** 1000 * 10 ** 1000 // 10")) == 4000
    half = "10 ** 1000 * 10 ** 1000 * 10 ** 150"
    largest = f"({half} - 1) * ({half} + 1)"  # 10 ** 4300 - 1
    assert _calc(largest) == "9" * MAX_DIGITS
    with pytest.raises(ValueError, match=f"the result of \\+ has more than {MAX_DIGITS} digits"):
        _calc(f"{largest} + 1")


def test_arguments_must_be_one_expression_string() -> None:
    for arguments in ({}, {"expression": 1}, {"expression": "1", "extra": 2}, {"expr": "1"}):
        with pytest.raises(ValueError, match='calculator takes {"expression": "<arithmetic>"}'):
            calculator(arguments, {})


def test_an_overlong_expression_is_refused() -> None:
    with pytest.raises(ValueError, match="the expression has 10001 characters; the most is 10000"):
        evaluate("1" + "+1" * 5000)


def test_format_number() -> None:
    assert [format_number(Fraction(n, d)) for n, d in [(3, 1), (-1, 8), (1, 3), (-5, 4), (1, 10**50)]] == [
        "3",
        "-0.125",
        "1/3",
        "-1.25",
        "0." + "0" * 49 + "1",
    ]
