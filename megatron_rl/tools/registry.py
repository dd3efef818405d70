"""Tool registry and the tool contract.

Contract: a tool is a module-level callable

    fn(arguments: Mapping[str, Any], context: Mapping[str, Any]) -> str

``arguments`` is the JSON object of the model's call (``{"expression": "1+2"}``); ``context`` is the
per-episode data of the prompt row, ``extra_info["tools_kwargs"][tool_name]``, empty when the row
has none. That key is verl's convention: its datasets put ``extra_info["tools_kwargs"]`` into each
row, and its ``ToolAgentLoop._call_tool`` takes ``tools_kwargs.get(tool_name, {})`` and hands the
entry's ``"create_kwargs"`` to the tool (read in volcengine/verl
``verl/experimental/agent_loop/tool_agent_loop.py``). Our tools get the whole entry, so a verl
dataset's tool reads ``context["create_kwargs"]``. The returned text is what the model reads as the
tool's output. A tool raises for a call it cannot answer (bad arguments, a failure of its own): the
call counts as failed and the model reads ``error: <exception>`` instead (see
:class:`megatron_rl.rollout.tool_pool.ToolPool`, where tools run in worker processes and are looked
up there by name, so they must be defined at module top level).

A tool is named in the recipe (``rollout.tools``) by its registered name or an import path
``"package.module:function"``; the model calls it by that registered name, or by the function's
name for an import path (:func:`tool_call_name`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

from megatron_rl.named_functions import find_function, register_function


class ToolFn(Protocol):
    """Signature every tool satisfies (see the module docstring)."""

    def __call__(self, arguments: Mapping[str, Any], context: Mapping[str, Any]) -> str: ...


class LimitedOutput(str):
    """A tool's text when one of its limits stopped the work (the python tool's sandbox): the model reads it as
    the output, as any other; the call counts as stopped by a limit (``rollout/tool_limit_stops``)."""

    __slots__ = ()


class ToolContractError(TypeError):
    """A tool violates the contract; the message says which part and how to fix it."""


_F = TypeVar("_F", bound=Callable[..., str])
_REGISTRY: dict[str, Callable[..., str]] = {}
_REQUIREMENTS: dict[Callable[..., str], Callable[[], str | None]] = {}


def register_tool(name: str, *, requires: Callable[[], str | None] | None = None) -> Callable[[_F], _F]:
    """Decorator registering a top-level tool under ``name``; returns it unchanged.

    ``requires`` says why the tool cannot run on this machine (None when it can); the tool pool asks it
    before it starts (:func:`tool_problem`). Re-registering the same function is a no-op; a different
    function under a taken name raises ValueError naming both; a nested function raises ToolContractError.
    """
    register = register_function(_REGISTRY, "tool", name, ToolContractError)

    def decorator(fn: _F) -> _F:
        register(fn)
        if requires is not None:
            _REQUIREMENTS[fn] = requires
        return fn

    return decorator


def registered_tools() -> tuple[str, ...]:
    """Names of all registered tools, sorted."""
    return tuple(sorted(_REGISTRY))


def get_tool(name: str) -> ToolFn:
    """The tool registered as ``name``, or the one ``"package.module:function"`` imports.

    ValueError for an unknown name (listing the registered ones), an import path whose module cannot
    be imported or lacks the attribute; TypeError when the attribute is not callable.
    """
    return find_function(_REGISTRY, "tool", name)


def tool_problem(tool: ToolFn) -> str | None:
    """Why ``tool`` cannot run on this machine (what its registration ``requires`` reports), None when it can."""
    requirement = _REQUIREMENTS.get(tool)
    return None if requirement is None else requirement()


def tool_call_name(name: str) -> str:
    """The name the model calls the tool ``name`` (a recipe entry) by: itself, or an import path's function name."""
    return name.rpartition(":")[2]
