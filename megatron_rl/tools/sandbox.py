"""Run untrusted Python source in a sandbox: no network, no host files, one private writable directory, limits.

Isolation (set up by :mod:`megatron_rl.tools.sandbox_init`, which needs root: namespaces and mounts):

- namespaces of its own: network (only a loopback, left down: no address is reachable, not even the
  host's 127.0.0.1), mount, PID (the code sees only its own processes), IPC and UTS;
- a root of its own (``pivot_root``; the host's tree is detached): read-only bind mounts of the Python
  installation (``sys.base_prefix``: the standard library, not a virtual environment's packages) and
  the system libraries it links (``/usr/lib``, ``/usr/lib64``, ``/lib``, ``/lib64``,
  ``/etc/ld.so.cache``, those that exist), ``/dev/null``, ``/dev/zero``, ``/dev/random``,
  ``/dev/urandom``, the code as ``/main.py``, and ``/tmp``: an empty tmpfs of ``disk_bytes``, the
  only writable place, the working directory and ``HOME``, gone when the run ends. Nothing else of
  the host (its ``/tmp``, ``/root``, ``/work``, ``/proc``, the run's keys and checkpoints) exists inside;
- an unprivileged uid of its own (``UID_BASE`` + the set-up process's host pid): it owns no host file,
  and each sandbox gets its own process count (``RLIMIT_NPROC`` counts per uid, so a shared uid such
  as nobody would let one sandbox's fork bomb starve every other). No capabilities, no new privileges
  (``PR_SET_NO_NEW_PRIVS``, and every bind mount is ``nosuid``);
- the interpreter runs as ``python -I -B /main.py``: isolated mode, no environment variables read.

Limits (:class:`SandboxLimits`) and what reports each in :attr:`SandboxResult.stopped`:

- ``cpu_time``: ``RLIMIT_CPU`` on the code's process (SIGXCPU, then SIGKILL a second later);
- ``wall_time``: the parent kills the sandbox at ``wall_time_s`` (killing the set-up process takes
  the PID namespace and every process in it down);
- ``output``: stdout or stderr passed ``output_bytes``: the sandbox is killed, each stream is kept
  truncated to ``output_bytes``;
- ``memory``: ``RLIMIT_AS`` per process; reported when the code ended on an uncaught ``MemoryError``;
- ``processes``: ``RLIMIT_NPROC`` (threads count too); reported when the code ended on an uncaught
  ``BlockingIOError: [Errno 11]`` (a refused fork) or ``can't start new thread``;
- ``file_size``: ``RLIMIT_FSIZE`` per file; reported on an uncaught ``[Errno 27] File too large``;
- ``disk``: the ``/tmp`` tmpfs is full; reported on an uncaught ``[Errno 28] No space left on device``.

The last four are read from stderr when the code failed (a non-zero exit): the last line that starts
with one of those errors (Python's report of an uncaught exception) names the limit. So code that
catches the error and exits 0 was not stopped; code that fails after printing such a line itself is
reported as stopped. When the code's first process ends, the others end with it (the PID namespace's PID 1
exits). Where any set-up step fails, :func:`run_sandboxed` raises :class:`SandboxUnavailableError`
naming the step: the code never runs unconfined.
"""

from __future__ import annotations

import json
import math
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

StopReason = Literal["cpu_time", "wall_time", "memory", "output", "processes", "file_size", "disk"]

INIT_SCRIPT = Path(__file__).with_name("sandbox_init.py")
UID_BASE = 1_000_000
"""Sandboxed code runs as uid ``UID_BASE`` + its set-up process's host pid (unique while that runs)."""
SYSTEM_LIBRARIES = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/etc/ld.so.cache")
KILL_GRACE_S = 5.0
"""Seconds the parent keeps reading a killed sandbox's output before it gives up on the pipes."""
_STDERR_STOPS: tuple[tuple[str, StopReason], ...] = (
    ("MemoryError", "memory"),
    ("BlockingIOError: [Errno 11]", "processes"),
    ("RuntimeError: can't start new thread", "processes"),
    ("OSError: [Errno 27]", "file_size"),
    ("OSError: [Errno 28]", "disk"),
)


class SandboxUnavailableError(RuntimeError):
    """The sandbox cannot be set up here; the message names the step that failed and why."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandboxed run may use; every value must be positive (ValueError otherwise)."""

    cpu_time_s: float = 10.0
    wall_time_s: float = 20.0
    memory_bytes: int = 1 << 30
    processes: int = 32
    output_bytes: int = 16 << 10
    file_size_bytes: int = 16 << 20
    disk_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"SandboxLimits.{name} must be positive, got {value}")


@dataclass(frozen=True)
class SandboxResult:
    """How a sandboxed run ended.

    ``stdout`` and ``stderr`` are decoded as UTF-8 (undecodable bytes replaced), each at most
    ``output_bytes`` long before decoding. ``exit_code``: the code's exit status, ``-N`` when signal N
    ended it, None when the sandbox was killed before it ended (``wall_time``, ``output``).
    ``stopped``: the limit that stopped it (see the module docstring), None when none did.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    stopped: StopReason | None


def sandbox_problem() -> str | None:
    """None when code can be sandboxed on this machine, else what is missing: it runs ``print('ok')`` in one."""
    try:
        result = run_sandboxed("print('ok')")
    except SandboxUnavailableError as exc:
        return str(exc)
    if result.stdout != "ok\n" or result.exit_code != 0:
        return (
            f"a trial run of print('ok') in the sandbox printed {result.stdout!r} and exited with "
            f"{result.exit_code} (stopped: {result.stopped}); stderr: {result.stderr[-500:]!r}"
        )
    return None


def run_sandboxed(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run the Python source ``code`` in a new sandbox (module docstring) and return how it ended.

    Blocks until the code ends or a limit stops it, about ``limits.wall_time_s`` at most.
    Raises SandboxUnavailableError, naming the step, when the sandbox cannot be set up.
    """
    if sys.platform != "linux":
        raise SandboxUnavailableError(f"the sandbox needs Linux namespaces; this is {sys.platform}")
    if os.geteuid() != 0:
        raise SandboxUnavailableError(
            f"the sandbox needs root to create namespaces and mounts; this process runs as uid {os.geteuid()}"
        )
    python = os.path.realpath(sys.executable)
    if not python.startswith(sys.base_prefix + os.sep):
        raise SandboxUnavailableError(f"the interpreter {python} lies outside its installation {sys.base_prefix}")
    root = tempfile.mkdtemp(prefix="megatron-rl-sandbox-")  # the mount point, inside the sandbox's namespace only
    status_read, status_write = os.pipe()
    try:
        try:
            process = subprocess.Popen(
                [sys.executable, "-I", "-S", str(INIT_SCRIPT)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_write,),
                env={},
            )
        finally:
            os.close(status_write)  # the sandbox holds it now: the report pipe ends when the sandbox does
        job = {
            **_job_limits(limits),
            "code": code,
            "root": root,
            "python": python,
            "binds": _binds(),
            "links": _links(),
            "uid": UID_BASE + process.pid,
            "status_fd": status_write,
            "parent_pid": os.getpid(),
        }
        stdout, stderr, killed_for = _communicate(process, json.dumps(job).encode(), limits)
        with os.fdopen(status_read, "rb") as status_file:
            status_read = -1
            reports = [json.loads(line) for line in status_file.read().splitlines()]
    finally:
        if status_read >= 0:
            os.close(status_read)
        os.rmdir(root)
    return _result(reports, stdout, stderr, killed_for, process.returncode, limits)


def _job_limits(limits: SandboxLimits) -> dict[str, int | float]:
    return {
        "cpu_time_s": math.ceil(limits.cpu_time_s),
        "wall_time_s": limits.wall_time_s,
        "memory_bytes": limits.memory_bytes,
        "processes": limits.processes,
        "file_size_bytes": limits.file_size_bytes,
        "disk_bytes": limits.disk_bytes,
    }


def _binds() -> list[str]:
    """The host paths bound read-only into the root: the Python installation and the system libraries."""
    binds = [sys.base_prefix]
    for path in SYSTEM_LIBRARIES:
        inside_a_bind = any(path == bind or path.startswith(bind + os.sep) for bind in binds)
        if os.path.exists(path) and not os.path.islink(path) and not inside_a_bind:
            binds.append(path)
    return binds


def _links() -> list[tuple[str, str]]:
    """The system library paths that are symbolic links (``/lib -> usr/lib``), recreated as such."""
    return [(path, os.readlink(path)) for path in SYSTEM_LIBRARIES if os.path.islink(path)]


def _communicate(
    process: subprocess.Popen[bytes], job: bytes, limits: SandboxLimits
) -> tuple[bytes, bytes, StopReason | None]:
    """Send the job, read stdout and stderr until both close; kill the sandbox past the wall or output limit."""
    assert process.stdin is not None and process.stdout is not None and process.stderr is not None
    try:
        process.stdin.write(job)
        process.stdin.close()
    except BrokenPipeError:
        pass  # the set-up process died at once; its report or exit code says why
    deadline = time.monotonic() + limits.wall_time_s
    out, err = process.stdout.fileno(), process.stderr.fileno()
    buffers = {out: bytearray(), err: bytearray()}
    killed_for: StopReason | None = None
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            events = selector.select(max(0.0, deadline - time.monotonic()))
            if not events and time.monotonic() >= deadline:
                if killed_for is not None:
                    break  # killed, yet something still holds the pipes: stop reading
                killed_for = "wall_time"
                process.kill()
                deadline = time.monotonic() + KILL_GRACE_S
            for key, _ in events:
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                buffer = buffers[key.fd]
                room = max(0, limits.output_bytes - len(buffer))
                buffer += chunk[:room]
                if len(chunk) > room and killed_for is None:
                    killed_for = "output"
                    process.kill()
                    deadline = time.monotonic() + KILL_GRACE_S
    process.stdout.close()
    process.stderr.close()
    process.wait()
    return bytes(buffers[out]), bytes(buffers[err]), killed_for


def _result(
    reports: list[dict[str, Any]],
    stdout: bytes,
    stderr: bytes,
    killed_for: StopReason | None,
    returncode: int,
    limits: SandboxLimits,
) -> SandboxResult:
    """The result from the sandbox's reports; SandboxUnavailableError when set-up failed."""
    errors = [str(report["error"]) for report in reports if "error" in report]
    if errors:
        raise SandboxUnavailableError(f"cannot set up the sandbox: {errors[0]}")
    ends = [report for report in reports if "error" not in report]
    err_text = stderr.decode("utf-8", "replace")
    if not ends and killed_for is None:
        raise SandboxUnavailableError(
            f"the sandbox's set-up process exited with {returncode} without a report; stderr: {err_text[-1000:]!r}"
        )
    out_text = stdout.decode("utf-8", "replace")
    if not ends:
        return SandboxResult(out_text, err_text, None, killed_for)
    end = ends[0]
    exit_code = -end["signal"] if "signal" in end else end["exit_code"]
    return SandboxResult(out_text, err_text, exit_code, killed_for or _stop_reason(end, exit_code, err_text, limits))


def _stop_reason(end: dict[str, Any], exit_code: int, stderr: str, limits: SandboxLimits) -> StopReason | None:
    """Which limit ended code that ended by itself or by a signal (see the module docstring)."""
    cpu_limit_reached = end["cpu_s"] >= math.ceil(limits.cpu_time_s)
    if exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL and cpu_limit_reached):
        return "cpu_time"
    if exit_code == 0:
        return None
    for line in reversed(stderr.splitlines()):  # the last report wins; a fork bomb's children interleave theirs
        for prefix, reason in _STDERR_STOPS:
            if line.startswith(prefix):
                return reason
    return None
