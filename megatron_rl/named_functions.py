"""Registries of module-level functions looked up by a registered name or a ``"package.module:function"`` path.

Rewards (:mod:`megatron_rl.data.rewards`) and tools (:mod:`megatron_rl.tools.registry`) are plug-ins of this
kind: they run in spawned worker processes that look them up by the string the recipe gives, so a
function must be importable by reference (defined at module top level: not nested, not a method).
Each kind keeps its own ``dict`` of names; messages name the kind (``reward``, ``tool``) and the value,
and the caller prefixes the recipe field. Imports nothing beyond the standard library.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, cast


def qualified_name(fn: Callable[..., Any]) -> str:
    """``module.qualname`` of a function, for messages."""
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def import_path(fn: Callable[..., Any]) -> str:
    """``"package.module:function"``, the path :func:`find_function` imports a top-level function by."""
    return f"{fn.__module__}:{getattr(fn, '__qualname__', '?')}"


def register_function[F: Callable[..., Any]](
    registry: MutableMapping[str, Any], kind: str, name: str, contract_error: type[Exception]
) -> Callable[[F], F]:
    """Decorator putting a top-level function into ``registry`` under ``name``; returns the function unchanged.

    ValueError for an empty name or one containing ':' (reserved for import paths). Registering the same
    function again (a worker re-importing its module) is a no-op; a different function under a taken
    name raises ValueError naming both; a nested function or a method raises ``contract_error``.
    """
    if not name or ":" in name:
        raise ValueError(f"{kind} name {name!r} must be non-empty and contain no ':' (reserved for import paths)")

    def decorator(fn: F) -> F:
        if "." in getattr(fn, "__qualname__", ""):
            raise contract_error(
                f"{kind} {name!r}: {qualified_name(fn)} is nested or a method; define it at module top level "
                "so worker processes can unpickle it"
            )
        existing = registry.get(name)
        if existing is not None and qualified_name(existing) != qualified_name(fn):
            raise ValueError(
                f"{kind} name {name!r} is already registered to {qualified_name(existing)}; "
                f"cannot register {qualified_name(fn)} under it"
            )
        registry[name] = fn
        return fn

    return decorator


def find_function[F: Callable[..., Any]](registry: Mapping[str, F], kind: str, name: str) -> F:
    """The function ``registry`` holds as ``name``, or the one ``"package.module:function"`` imports.

    ValueError for an unknown name (listing the registered ones), a malformed import path, a module that
    cannot be imported or lacks the attribute; TypeError when the attribute is not callable.
    """
    if ":" not in name:
        if name not in registry:
            raise ValueError(
                f"unknown {kind} {name!r}; registered {kind}s: {', '.join(sorted(registry))}; "
                "or give an import path 'package.module:function'"
            )
        return registry[name]
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute.isidentifier():
        raise ValueError(f"{kind} import path {name!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{kind} {name!r}: cannot import module {module_name!r}: {exc}") from exc
    if not hasattr(module, attribute):
        raise ValueError(f"{kind} {name!r}: module {module_name!r} has no attribute {attribute!r}")
    fn = getattr(module, attribute)
    if not callable(fn):
        raise TypeError(f"{kind} {name!r}: {module_name}.{attribute} is a {type(fn).__name__}, not a function")
    return cast(F, fn)  # callable, but its signature is unchecked: the import path names the caller's F
