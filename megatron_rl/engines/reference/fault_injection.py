"""A crash injected into reference engine processes for reliability tests; set in the environment, never by a recipe.

``MEGATRON_RL_FAULT_ENGINE_EXIT="N:TIMES:DIR"``: an engine process exits at once with code
:data:`EXIT_CODE` when it receives its N-th ``/generate`` request (1-based, counted from its start),
with the requests it holds unanswered, as a process killed by the kernel leaves them. ``DIR``
holds one file per crash so far (of any engine of the run); once it holds ``TIMES``, no engine
exits any more, so a restarted engine runs on. N = 0: at start-up, before it serves (an engine that cannot
start). ``tests/faults/`` uses it to check engine restarts (``docs/reliability.md``), ``tests/e2e/test_preflight.py``
preflight's engines step.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

ENGINE_EXIT_ENV = "MEGATRON_RL_FAULT_ENGINE_EXIT"
EXIT_CODE = 17

_lock = threading.Lock()
_generate_requests = 0


def engine_exit_fault(after_requests: int, times: int, directory: str | Path) -> str:
    """The value of :data:`ENGINE_EXIT_ENV` for a crash on the ``after_requests``-th request, ``times`` in all."""
    return f"{after_requests}:{times}:{directory}"


def _exit_unless_crashed_enough(times: int, directory: str) -> None:
    """Exit (code :data:`EXIT_CODE`) unless ``directory`` already holds ``times`` crashes; record this one."""
    crashes = Path(directory)
    crashes.mkdir(parents=True, exist_ok=True)
    for crash in range(times):
        try:  # engines reaching the request at once race here: exclusive creation lets exactly TIMES exit
            os.close(os.open(crashes / f"crash-{crash}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        os._exit(EXIT_CODE)


def exit_at_start_if_asked() -> None:
    """At start-up: exit when the environment asks for a crash on request 0."""
    value = os.environ.get(ENGINE_EXIT_ENV, "").strip()
    if value:
        after, times, directory = value.split(":", 2)
        if int(after) == 0:
            _exit_unless_crashed_enough(int(times), directory)


def exit_if_asked() -> None:
    """Count one ``/generate`` request; exit the process (code :data:`EXIT_CODE`) when the environment says so."""
    global _generate_requests
    value = os.environ.get(ENGINE_EXIT_ENV, "").strip()
    if not value:
        return
    after, times, directory = value.split(":", 2)
    with _lock:
        _generate_requests += 1
        if _generate_requests == int(after):
            _exit_unless_crashed_enough(int(times), directory)
