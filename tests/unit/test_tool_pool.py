"""The tool pool: real tools in spawned worker processes; a tool that raises, hangs, dies or is unknown fails
that call only (with a message the model reads), is logged once, and the pool goes on.

The faulty tools are real functions reached by import path (``tests/faults/tools.py``); the python tool
runs real code in the real sandbox.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator

import pytest

from megatron_rl.rollout.tool_pool import ToolOutput, ToolPool
from megatron_rl.tools import ToolCall
from tests.faults.tools import UNAVAILABLE_REASON

TIMEOUT_S = 2.0
FAULTS = "tests.faults.tools"
TOOLS = [
    "calculator",
    "python",
    *(f"{FAULTS}:{name}" for name in ("raising", "hanging", "exiting", "not_text", "echo")),
]


@pytest.fixture(scope="module")
def pool() -> Iterator[ToolPool]:
    tools = ToolPool(TOOLS, 2, TIMEOUT_S)
    yield tools
    tools.close()


def _call(pool: ToolPool, name: str, context: dict[str, object] | None = None, **arguments: object) -> ToolOutput:
    return pool.submit(ToolCall(name, dict(arguments)), context or {}).result(timeout=60)


def test_calculator_and_python_answer(pool: ToolPool) -> None:
    futures = [
        pool.submit(ToolCall("calculator", {"expression": "2 + 3 * 4"}), {}),
        pool.submit(ToolCall("python", {"code": "print(sum(range(10)))"}), {}),
        pool.submit(ToolCall("calculator", {"expression": "1/3 + 1/5"}), {}),
    ]
    assert [future.result(timeout=60) for future in futures] == [
        ToolOutput("14"),
        ToolOutput("45\n"),
        ToolOutput("8/15"),
    ]


def test_the_episode_context_reaches_the_tool(pool: ToolPool) -> None:
    output = _call(pool, "echo", {"create_kwargs": {"ground_truth": "4"}}, x=1)
    assert output.failure is None
    assert json.loads(output.text) == {"arguments": {"x": 1}, "context": {"create_kwargs": {"ground_truth": "4"}}}


def test_a_raising_tool_is_an_error_the_model_reads_logged_once(
    pool: ToolPool, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="megatron_rl.rollout.tool_pool"):
        output = _call(pool, "raising", x=1)
        refused = _call(pool, "calculator", expression="1/0")
    assert output == ToolOutput("error: ValueError: tool crashed on {'x': 1}", "error")
    assert refused == ToolOutput("error: ValueError: division by zero: 1 / 0", "error")
    first, second = caplog.records
    assert "tool call 'raising' failed (error)" in first.getMessage() and "Traceback" in first.getMessage()
    assert "tool call 'calculator' failed (error)" in second.getMessage()
    assert _call(pool, "calculator", expression="6*7") == ToolOutput("42")


def test_a_tool_returning_no_text_breaks_the_contract_as_an_error(pool: ToolPool) -> None:
    assert _call(pool, "not_text") == ToolOutput("error: TypeError: the tool returned int, not str", "error")


def test_a_hung_tool_times_out_and_a_fresh_worker_takes_the_next_call(
    pool: ToolPool, caplog: pytest.LogCaptureFixture
) -> None:
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="megatron_rl.rollout.tool_pool"):
        hung = [pool.submit(ToolCall("hanging", {}), {}) for _ in range(2)]
        outputs = [future.result(timeout=60) for future in hung]
    assert outputs == [ToolOutput("error: the tool ran past 2 s", "timeout")] * 2
    assert len(caplog.records) == 2 and "killed and replaced" in caplog.text
    assert _call(pool, "calculator", expression="2**10") == ToolOutput("1024")
    assert _call(pool, "python", code="print('after')") == ToolOutput("after\n")
    assert time.monotonic() - start < 60


def test_a_tool_that_kills_its_worker_is_an_error_and_the_pool_recovers(pool: ToolPool) -> None:
    assert _call(pool, "exiting") == ToolOutput("error: the tool's process exited with code 3", "error")
    assert [_call(pool, "calculator", expression=f"{n}+1") for n in range(3)] == [
        ToolOutput("1"),
        ToolOutput("2"),
        ToolOutput("3"),
    ]


def test_an_unknown_tool_is_named_with_the_tools_there_are(pool: ToolPool, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="megatron_rl.rollout.tool_pool"):
        output = _call(pool, "search", query="x")
    names = "calculator, python, raising, hanging, exiting, not_text, echo"
    assert output == ToolOutput(f"error: unknown tool 'search'; tools: {names}", "unknown_tool")
    assert len(caplog.records) == 1


def test_an_import_path_tool_answers_to_its_full_entry_too(pool: ToolPool) -> None:
    assert json.loads(_call(pool, f"{FAULTS}:echo").text) == {"arguments": {}, "context": {}}


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("1/0", "ZeroDivisionError: division by zero\n"),
        ("x = bytearray(2**31)", "MemoryError\n[stopped: it ran out of its 1024 MiB of memory]\n"),
        ("import os\nwhile True:\n    os.fork()", "[stopped: it reached its 8 processes]\n"),
        ("print('x' * 100_000)", "[stopped: its output passed 16384 bytes and is cut there]\n"),
        (
            "import socket\nsocket.create_connection(('1.1.1.1', 80))",
            "OSError: [Errno 97] Address family not supported by protocol\n",
        ),
    ],
)
def test_code_the_sandbox_stops_is_a_result_the_model_reads_and_a_stop_is_counted(
    pool: ToolPool, code: str, expected: str
) -> None:
    output = _call(pool, "python", code=code)
    assert output.failure == ("limit" if "[stopped:" in expected else None), output
    assert output.text.endswith(expected), output.text[-300:]
    assert _call(pool, "calculator", expression="1+1") == ToolOutput("2")


def test_bad_python_arguments_are_an_error(pool: ToolPool) -> None:
    output = _call(pool, "python", source="print(1)")
    assert output.failure == "error" and output.text.startswith('error: ValueError: python takes {"code"')


def test_calls_run_in_parallel_on_the_workers() -> None:
    tools = ToolPool([f"{FAULTS}:interval"], 2, 30.0)
    try:
        futures = [tools.submit(ToolCall("interval", {"seconds": 1.0}), {}) for _ in range(2)]
        (start_a, end_a), (start_b, end_b) = (map(float, f.result(timeout=60).text.split()) for f in futures)
    finally:
        tools.close()
    assert max(start_a, start_b) < min(end_a, end_b)  # the two sleeps overlapped


def test_close_cancels_queued_calls() -> None:
    tools = ToolPool([f"{FAULTS}:interval"], 1, 30.0)
    running = tools.submit(ToolCall("interval", {"seconds": 1.0}), {})
    queued = tools.submit(ToolCall("interval", {"seconds": 1.0}), {})
    time.sleep(0.2)  # the worker's thread has taken the first call
    tools.close()
    assert running.result(timeout=60).failure is None
    assert queued.cancelled()


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        (["no_such_tool"], r"rollout.tools: unknown tool 'no_such_tool'; registered tools: .*calculator, python"),
        ([f"{FAULTS}:missing"], rf"rollout.tools: .*module '{FAULTS}' has no attribute 'missing'"),
        (["no_such_module:tool"], r"rollout.tools: .*cannot import module 'no_such_module'"),
        (
            [f"{FAULTS}:unavailable"],
            rf"rollout.tools: .*tool '{FAULTS}:unavailable' cannot run on this machine: "
            rf"{UNAVAILABLE_REASON}",
        ),
    ],
)
def test_a_tool_that_cannot_load_or_run_here_fails_the_pool_naming_the_field(tools: list[str], message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        ToolPool(tools, 2, 1.0)


def test_the_pool_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_workers must be >= 1"):
        ToolPool(["calculator"], 0, 1.0)
    with pytest.raises(ValueError, match="timeout_s > 0"):
        ToolPool(["calculator"], 1, 0.0)
    with pytest.raises(ValueError, match="rollout.tools: .* each called by its own name"):
        ToolPool(["calculator", f"{FAULTS}:calculator"], 1, 1.0)
    with pytest.raises(ValueError, match="at least one tool"):
        ToolPool([], 1, 1.0)
