"""Tool registry: registered names, import paths, the contract's refusals, and what a tool needs to run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from megatron_rl.tools import (
    ToolContractError,
    get_tool,
    python_tool,
    register_tool,
    registered_tools,
    run_sandboxed,
    sandbox_problem,
    tool_call_name,
    tool_problem,
)
from megatron_rl.tools import registry as tool_registry
from megatron_rl.tools.calculator import calculator
from megatron_rl.tools.python_tool import python
from megatron_rl.tools.sandbox_service import SandboxService, service_in_use
from tests.faults.tools import UNAVAILABLE_REASON

FAULTS = "tests.faults.tools"


def shout(arguments: Mapping[str, Any], context: Mapping[str, Any]) -> str:
    return str(arguments["text"]).upper()


def whisper(arguments: Mapping[str, Any], context: Mapping[str, Any]) -> str:
    return str(arguments["text"]).lower()


def _never_here() -> str:
    return "needs a machine this is not"


@pytest.fixture
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tool_registry, "_REGISTRY", dict(tool_registry._REGISTRY))
    monkeypatch.setattr(tool_registry, "_REQUIREMENTS", dict(tool_registry._REQUIREMENTS))


def test_the_builtin_tools_are_registered_and_run_here() -> None:
    assert {"calculator", "python"} <= set(registered_tools())
    assert get_tool("calculator") is calculator and get_tool("python") is python
    assert get_tool("calculator")({"expression": "7*6"}, {}) == "42"
    assert tool_problem(calculator) is None
    assert tool_problem(python) is None and sandbox_problem() is None  # the python tool needs the sandbox


def test_the_python_tool_requires_the_sandbox_unless_a_service_runs_its_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(python_tool, "sandbox_problem", lambda: "no namespaces here")
    assert tool_problem(python) == "no namespaces here"
    with service_in_use(SandboxService("http://127.0.0.1:9")):
        assert tool_problem(python) is None  # the service's answers say whether it runs
    monkeypatch.undo()
    assert python({"code": "print(6 * 7)"}, {}) == run_sandboxed("print(6 * 7)").stdout == "42\n"


def test_register_tool_adds_a_name_and_its_requirement(isolated_registry: None) -> None:
    assert register_tool("shout")(shout) is shout
    assert get_tool("shout") is shout and "shout" in registered_tools()
    assert register_tool("shout")(shout) is shout  # a worker re-importing its module
    assert tool_problem(shout) is None
    register_tool("whisper", requires=_never_here)(whisper)
    assert tool_problem(whisper) == "needs a machine this is not"


def test_register_tool_refuses_a_taken_name_nested_functions_and_bad_names(isolated_registry: None) -> None:
    register_tool("shout")(shout)
    with pytest.raises(
        ValueError, match="tool name 'shout' is already registered to .*shout; cannot register .*whisper"
    ):
        register_tool("shout")(whisper)

    def nested(arguments: Mapping[str, Any], context: Mapping[str, Any]) -> str:
        return ""

    with pytest.raises(
        ToolContractError, match="tool 'nested': .*nested is nested or a method; define it at module top"
    ):
        register_tool("nested")(nested)
    for name in ("", "a:b"):
        with pytest.raises(ValueError, match="must be non-empty and contain no ':'"):
            register_tool(name)


def test_an_unknown_name_lists_the_registered_tools() -> None:
    with pytest.raises(ValueError, match=r"unknown tool 'search'; registered tools: .*calculator, python.*; or give"):
        get_tool("search")


def test_an_import_path_loads_a_tool_and_its_requirement() -> None:
    tool = get_tool(f"{FAULTS}:echo")
    assert tool({"x": 1}, {"k": "v"}) == '{"arguments": {"x": 1}, "context": {"k": "v"}}'
    assert tool_problem(tool) is None
    assert tool_problem(get_tool(f"{FAULTS}:unavailable")) == UNAVAILABLE_REASON


def test_import_path_errors_name_the_tool() -> None:
    # The lookup is the rewards' (tests/unit/test_data_reward_registry.py covers every error); messages say "tool".
    with pytest.raises(ValueError, match="tool 'no_such_tool_module:f': cannot import module 'no_such_tool_module'"):
        get_tool("no_such_tool_module:f")
    with pytest.raises(TypeError, match=f"tool '{FAULTS}:UNAVAILABLE_REASON': .* is a str, not a function"):
        get_tool(f"{FAULTS}:UNAVAILABLE_REASON")


def test_the_model_calls_a_tool_by_its_name_or_its_functions_name() -> None:
    assert tool_call_name("calculator") == "calculator"
    assert tool_call_name("my_pkg.tools:search") == "search"
