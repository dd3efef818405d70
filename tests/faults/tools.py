"""Tools with injected faults, imported by path in tool worker processes (module level: workers import them by name)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

from megatron_rl.tools import register_tool

UNAVAILABLE_REASON = "the test's stand-in for a missing sandbox"


def raising(arguments: Mapping[str, Any], context: Mapping[str, Any]) -> str:
    """Raises ValueError naming its arguments."""
    raise ValueError(f"tool crashed on {dict(arguments)!r}")


def hanging(arguments: Mapping[str, Any], context: Mapping[str, Any]) -> str:
    """Sleeps far past any tool timeout."""
    time.sleep(3600)
    return "never"


def exiting(arguments: Mapping[str, Any], context: Mapping[str, Any]) -> str:
    """Kills its own worker process with exit code 3."""
    os._exit(3)


def not_text(arguments: Mapping[str, Any], context: Mapping[str, Any]) -> str:
    """Breaks the contract: returns an int."""
    return 42  # type: ignore[return-value]


def echo(arguments: Mapping[str, Any], context: Mapping[str, Any]) -> str:
    """Its arguments and context as JSON."""
    return json.dumps({"arguments": arguments, "context": context}, sort_keys=True)


def interval(arguments: Mapping[str, Any], context: Mapping[str, Any]) -> str:
    """Sleeps ``arguments["seconds"]`` and returns its start and end times (``time.time()``), space-separated."""
    start = time.time()
    time.sleep(float(arguments["seconds"]))
    return f"{start} {time.time()}"


def _missing() -> str:
    return UNAVAILABLE_REASON


@register_tool("test_unavailable", requires=_missing)
def unavailable(arguments: Mapping[str, Any], context: Mapping[str, Any]) -> str:
    """A tool whose requirement is never met (as the python tool's where no sandbox can be made)."""
    return "never"
