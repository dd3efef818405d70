"""The ``python`` tool: run the model's Python source in the sandbox (:mod:`megatron_rl.tools.sandbox`).

Arguments: ``{"code": "<python source>"}``. The model reads what the code printed: its stdout; and
its stderr too when it failed (a non-zero exit: an uncaught exception's traceback); and a last line
``[stopped: ...]`` when a limit stopped it (``SandboxLimits()``: the defaults). Code that fails is a
normal output, not a failed call (a limit's stop is counted apart: the text is a
:class:`~megatron_rl.tools.registry.LimitedOutput`): the tool raises only for bad arguments (ValueError) and where the
sandbox cannot be set up (SandboxUnavailableError); the tool pool then counts the call as failed.
Where the code runs: the local sandbox, or the service :func:`~megatron_rl.tools.sandbox_service.use_service`
set in this process (the recipe's ``rollout.tool_sandbox``, set in each tool worker): the same text for the
same result either way (:func:`output_text`); a service that gives no result raises SandboxServiceError. It
runs nowhere else: without a service, the pool refuses to start it where
:func:`~megatron_rl.tools.sandbox.sandbox_problem` reports a problem.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_rl.tools.registry import LimitedOutput, register_tool
from megatron_rl.tools.sandbox import SandboxLimits, SandboxResult, StopReason, run_sandboxed, sandbox_problem
from megatron_rl.tools.sandbox_service import current_service, run_remote

LIMITS = SandboxLimits()
_STOP_NOTES: dict[StopReason, str] = {
    "cpu_time": f"it used its {LIMITS.cpu_time_s:g} s of CPU time",
    "wall_time": f"it ran past {LIMITS.wall_time_s:g} s",
    "memory": f"it ran out of its {LIMITS.memory_bytes >> 20} MiB of memory",
    "output": f"its output passed {LIMITS.output_bytes} bytes and is cut there",
    "processes": f"it reached its {LIMITS.processes} processes",
    "file_size": f"it wrote a file past {LIMITS.file_size_bytes >> 20} MiB",
    "disk": f"it filled its {LIMITS.disk_bytes >> 20} MiB of disk",
}


def _sandbox_problem() -> str | None:
    """Why the python tool cannot run here: none with a service (its answers say), else the local sandbox's."""
    return None if current_service() is not None else sandbox_problem()


@register_tool("python", requires=_sandbox_problem)
def python(arguments: Mapping[str, Any], context: Mapping[str, Any]) -> str:
    """What ``arguments["code"]`` printed in the sandbox (see the module docstring); ``context`` is not used."""
    if set(arguments) != {"code"} or not isinstance(arguments["code"], str):
        raise ValueError(f'python takes {{"code": "<python source>"}}, got arguments {dict(arguments)!r}')
    service = current_service()
    code = arguments["code"]
    return output_text(run_sandboxed(code, LIMITS) if service is None else run_remote(code, LIMITS, service))


def output_text(result: SandboxResult) -> str:
    """What the model reads for ``result``: stdout, stderr when the code failed, the stop note when a limit
    stopped it, each ending in a newline; a LimitedOutput when a limit stopped it."""
    parts = [result.stdout]
    if result.exit_code != 0:
        parts.append(result.stderr)
    if result.stopped is not None:
        parts.append(f"[stopped: {_STOP_NOTES[result.stopped]}]\n")
    text = "".join(part if part.endswith("\n") or not part else part + "\n" for part in parts)
    return text if result.stopped is None else LimitedOutput(text)
