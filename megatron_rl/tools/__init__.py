"""Tools a model calls in multi-turn episodes, with the same contract and lookup as rewards.

Stdlib only: imports neither torch, Megatron nor Ray. Importing the package registers the built-in
tools ``calculator`` (exact arithmetic, :mod:`megatron_rl.tools.calculator`) and ``python`` (code in a
sandbox, :mod:`megatron_rl.tools.python_tool`) and ``synthetic_lookup`` (the tiny multi-turn recipe's table
lookup, :mod:`megatron_rl.tools.synthetic_lookup`). The contract: :mod:`megatron_rl.tools.registry`; the
chat format of calls and replies: :mod:`megatron_rl.tools.calls`; tool calls run in
:class:`megatron_rl.rollout.tool_pool.ToolPool`.
"""

from megatron_rl.tools.calculator import calculator
from megatron_rl.tools.calls import ToolCall, ToolCallError, parse_tool_calls, render_tool_responses
from megatron_rl.tools.python_tool import python
from megatron_rl.tools.registry import (
    ToolContractError,
    ToolFn,
    get_tool,
    register_tool,
    registered_tools,
    tool_call_name,
    tool_problem,
)
from megatron_rl.tools.sandbox import (
    SandboxLimits,
    SandboxResult,
    SandboxUnavailableError,
    run_sandboxed,
    sandbox_problem,
)
from megatron_rl.tools.synthetic_lookup import synthetic_lookup

__all__ = [
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailableError",
    "ToolCall",
    "ToolCallError",
    "ToolContractError",
    "ToolFn",
    "calculator",
    "get_tool",
    "parse_tool_calls",
    "python",
    "register_tool",
    "registered_tools",
    "render_tool_responses",
    "run_sandboxed",
    "sandbox_problem",
    "synthetic_lookup",
    "tool_call_name",
    "tool_problem",
]
