"""Launch and supervise one engine server process (SGLang or the reference server).

The process runs in its own session (so :meth:`ServerProcess.stop` can end
its whole process tree, e.g. SGLang's scheduler children) with stdout and
stderr appended to a log file; errors quote the log's tail. With
``die_with_parent`` (Linux) the kernel sends it SIGKILL when the thread that
started it ends, e.g. when its Ray actor is killed, so an engine never outlives
its host (SGLang's own children follow their parent the same way). With ``secrets``
the output goes through a pipe and a thread of this process copies it into the log
line by line, each secret replaced by ``<redacted>`` (SGLang logs its server
arguments, the API key among them).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

from megatron_rl.engines.access import REDACTED

LOG_TAIL_LINES = 40
LOG_TAIL_MAX_CHARS = 8000
"""A log tail is the last ``LOG_TAIL_LINES`` lines, cut to its last ``LOG_TAIL_MAX_CHARS`` characters."""
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def kill_when_parent_dies() -> None:
    """In a child (after fork, before exec): ask the kernel for SIGKILL when the parent (thread) ends (Linux)."""
    assert _LIBC is not None, "prctl is Linux's"
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _copy_redacted(source: BinaryIO, log_path: Path, secret_values: Sequence[bytes]) -> None:
    """Append ``source``'s lines to ``log_path`` with each secret replaced, until ``source`` closes."""
    with source, open(log_path, "ab") as log:
        for line in iter(source.readline, b""):
            for value in secret_values:
                line = line.replace(value, REDACTED.encode())
            log.write(line)
            log.flush()


class ServerProcess:
    """A server subprocess: ``start()``, ``exit_code`` (None while running), ``log_tail()``, ``stop()``.

    ``env`` is added to this process's environment. ``secrets``: values that must not reach the
    log (see the module docstring); keep them out of ``command`` (which anyone on the node can
    read in ``/proc``) and pass them through ``env`` or a private file instead.
    """

    def __init__(
        self,
        command: Sequence[str],
        log_path: str | Path,
        env: Mapping[str, str] | None = None,
        *,
        die_with_parent: bool = False,
        secrets: Sequence[str] = (),
    ) -> None:
        if die_with_parent and _LIBC is None:
            raise RuntimeError(f"die_with_parent needs Linux (prctl PR_SET_PDEATHSIG); this is {sys.platform}")
        self.command = list(command)
        self.log_path = Path(log_path)
        self.env = dict(env) if env is not None else None
        self.die_with_parent = die_with_parent
        self._secrets = [value.encode() for value in secrets if value]
        self._process: subprocess.Popen[bytes] | None = None
        self._copier: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"ServerProcess({' '.join(self.command)!r}, log={str(self.log_path)!r})"

    def start(self) -> None:
        """Start the process; RuntimeError if it is already running."""
        if self._process is not None and self._process.poll() is None:
            raise RuntimeError(f"server already running (pid {self._process.pid}): {' '.join(self.command)}")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                self.command,
                stdout=subprocess.PIPE if self._secrets else log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env} if self.env is not None else None,
                start_new_session=True,
                preexec_fn=kill_when_parent_dies if self.die_with_parent else None,
            )
        if self._secrets:
            self._copier = threading.Thread(
                target=_copy_redacted,
                args=(self._process.stdout, self.log_path, self._secrets),
                name=f"log-copy-{self._process.pid}",
                daemon=True,
            )
            self._copier.start()

    @property
    def pid(self) -> int | None:
        """The process id once started."""
        return None if self._process is None else self._process.pid

    @property
    def exit_code(self) -> int | None:
        """The exit status once the process ended; None while it runs (or before start)."""
        return None if self._process is None else self._process.poll()

    def wait_for_exit(self, timeout_s: float) -> int | None:
        """The exit status if the process ends within ``timeout_s`` (0: just poll); None if it still runs."""
        if self._process is None:
            return None
        try:
            return self._process.wait(timeout=timeout_s) if timeout_s > 0 else self._process.poll()
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, lines: int = LOG_TAIL_LINES, max_chars: int = LOG_TAIL_MAX_CHARS) -> str:
        """The log's last ``lines`` lines, at most its last ``max_chars`` characters ('' when no log yet)."""
        if self._copier is not None and self.exit_code is not None:
            self._copier.join(timeout=2.0)  # the last lines the process wrote
        if not self.log_path.exists():
            return ""
        with self.log_path.open("rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - 4 * max_chars))
            text = log.read().decode("utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])[-max_chars:]

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the process group, then SIGKILL after ``timeout_s``; a no-op when not running."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                return
            try:
                process.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue
