"""Run untrusted Python source in a sandbox: no network, no host files, one private writable directory, limits.

No root needed: :mod:`megatron_rl.tools.sandbox_init` does every privileged step inside a user
namespace it creates (Linux's unprivileged user namespaces). Our own code rather than bubblewrap
because bubblewrap is a system package a cluster user cannot install, while this needs only Python's
standard library and gives the same set-up (user namespace, pivot_root, seccomp filter). Isolation:

- namespaces of its own: user, network (only a loopback, left down: no address is reachable, not
  even the host's 127.0.0.1), mount, PID (the code sees only its own processes), IPC and UTS;
- a root of its own (``pivot_root``; the host's tree is detached): read-only bind mounts of the Python
  installation (``sys.base_prefix``: the standard library, not a virtual environment's packages) and
  the system libraries it links (``/usr/lib``, ``/usr/lib64``, ``/lib``, ``/lib64``,
  ``/etc/ld.so.cache``, those that exist), ``/dev/null``, ``/dev/zero``, ``/dev/random``,
  ``/dev/urandom``, the code as ``/main.py``, and ``/tmp``: an empty tmpfs of ``disk_bytes`` and
  ``disk_files`` inodes, the only writable place, the working directory and ``HOME``, gone when the run
  ends. Nothing else of the host (its ``/tmp``, ``/root``, ``/work``, ``/proc``, ``/dev/shm``, the run's
  keys and checkpoints) exists inside;
- uid and gid ``SANDBOX_UID`` inside, no capabilities (bounding and ambient sets emptied), no new
  privileges (``PR_SET_NO_NEW_PRIVS``; every bind mount is ``nosuid``). Outside, that uid is: run as
  root, a uid of the sandbox's own (``UID_BASE`` + its set-up process's pid), which owns no host file;
  run as a user, the user's own uid (host files stay out of reach through the mount namespace, and the
  user's supplementary groups stay, unmapped: a user namespace may not drop them). Each sandbox gets its
  own process count either way: ``RLIMIT_NPROC`` counts per uid *of each user namespace* (Linux >= 5.14),
  so one sandbox's fork bomb does not starve another, even of the same user;
- a seccomp filter (:func:`megatron_rl.tools.sandbox_init.seccomp_program`): sockets of ``AF_UNIX``
  only (no vsock, netlink, packet, raw or inet socket); no namespace, mount, ``bpf``,
  ``perf_event_open``, ``userfaultfd``, ``io_uring``, ``kexec``, module, keyring, ``ptrace`` or
  ``process_vm_*`` call; no ``memfd_create``, SysV IPC object or POSIX message queue (memory that
  ``RLIMIT_AS`` does not count); a syscall of another ABI (i386, x32) is refused;
- the interpreter runs as ``python -I -B /main.py``: isolated mode, no environment variables read.

Memory in total (:func:`memory_bound`): a memory cgroup is not used (few machines delegate one to a
user); the bounds add up instead: ``RLIMIT_AS`` x ``RLIMIT_NPROC`` (every process, threads, anonymous
shared memory), the ``/tmp`` tmpfs (files, also the ones mapped), no memfd, SysV or POSIX shared memory
(filtered; no ``/dev/shm``), ``RLIMIT_NOFILE`` (``open_files``: pipes and sockets each hold at most
their kernel buffer) and ``RLIMIT_MSGQUEUE`` 0.

Limits (:class:`SandboxLimits`) and what reports each in :attr:`SandboxResult.stopped`:

- ``cpu_time``: ``RLIMIT_CPU`` on the code's process (SIGXCPU, then SIGKILL a second later);
- ``wall_time``: the parent kills the sandbox at ``wall_time_s`` (killing the set-up process takes
  the PID namespace and every process in it down);
- ``output``: stdout or stderr passed ``output_bytes``: the sandbox is killed, each stream is kept
  truncated to ``output_bytes``;
- ``memory``: ``RLIMIT_AS`` per process (:func:`memory_bound` for the total); reported when the code ended on an uncaught ``MemoryError``;
- ``processes``: ``RLIMIT_NPROC`` (threads count too); reported when the code ended on an uncaught
  ``BlockingIOError: [Errno 11]`` (a refused fork) or ``can't start new thread``;
- ``file_size``: ``RLIMIT_FSIZE`` per file; reported on an uncaught ``[Errno 27] File too large``;
- ``disk``: the ``/tmp`` tmpfs is full; reported on an uncaught ``[Errno 28] No space left on device``.

The last four are read from stderr when the code failed (a non-zero exit): the last line that starts
with one of those errors (Python's report of an uncaught exception) names the limit. So code that
catches the error and exits 0 was not stopped; code that fails after printing such a line itself is
reported as stopped. When the code's first process ends, the others end with it (the PID namespace's PID 1
exits). Where any set-up step fails, :func:`run_sandboxed` raises :class:`SandboxUnavailableError`
naming the step and, where the machine's settings explain it, the setting and its fix
(:func:`namespace_hints`): the code never runs unconfined.
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
"""Run as root, sandboxed code runs as host uid ``UID_BASE`` + its set-up process's host pid (unique while that runs)."""
PROC_SYS = Path("/proc/sys")
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
    """What one sandboxed run may use; every value must be positive (ValueError otherwise).

    ``memory_bytes`` is per process and ``processes`` counts threads; ``disk_files`` bounds the inodes
    of ``/tmp`` (each costs kernel memory, even empty) and ``open_files`` the descriptors per process.
    :func:`memory_bound` is what they add up to.
    """

    cpu_time_s: float = 10.0
    wall_time_s: float = 20.0
    memory_bytes: int = 1 << 30
    processes: int = 8
    output_bytes: int = 16 << 10
    file_size_bytes: int = 16 << 20
    disk_bytes: int = 64 << 20
    disk_files: int = 4096
    open_files: int = 64

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


@dataclass(frozen=True)
class MemoryBound:
    """The most memory one sandbox can hold at once, and by which mechanism.

    ``mechanism`` is ``"rlimits"``: the sum of ``parts`` (bytes each): ``processes`` (``RLIMIT_AS`` x
    ``RLIMIT_NPROC``: every process's memory, anonymous shared memory counted in each mapper),
    ``disk`` (the ``/tmp`` tmpfs) and ``kernel_buffers`` (``RLIMIT_NOFILE`` descriptors per process,
    each a pipe or unix socket holding at most ``fs.pipe-max-size`` or twice ``net.core.wmem_max``).
    memfd, SysV and POSIX shared memory and message queues are refused, so they add nothing.
    """

    mechanism: Literal["rlimits"]
    total_bytes: int
    parts: dict[str, int]


def memory_bound(limits: SandboxLimits = SandboxLimits()) -> MemoryBound:
    """What ``limits`` bound a sandbox's memory to in total on this machine (see :class:`MemoryBound`)."""
    buffer = max(
        _read_int(PROC_SYS / "fs/pipe-max-size", 1 << 20), 2 * _read_int(PROC_SYS / "net/core/wmem_max", 1 << 20)
    )
    parts = {
        "processes": limits.processes * limits.memory_bytes,
        "disk": limits.disk_bytes,
        "kernel_buffers": limits.processes * limits.open_files * buffer,
    }
    return MemoryBound("rlimits", sum(parts.values()), parts)


def _read_int(path: Path, default: int) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def namespace_hints(proc_sys: Path = PROC_SYS, status: Path = Path("/proc/self/status")) -> list[str]:
    """The settings of this machine that stop a user from creating the sandbox's namespaces, each with its fix."""
    hints = []
    if _read_int(proc_sys / "user/max_user_namespaces", 1) == 0:
        hints.append(
            "user.max_user_namespaces=0 allows no user namespace; set it above 0 (sysctl -w user.max_user_namespaces=10000)"
        )
    if os.geteuid() != 0 and _read_int(proc_sys / "kernel/unprivileged_userns_clone", 1) == 0:
        hints.append(
            "kernel.unprivileged_userns_clone=0 refuses user namespaces to users; set it to 1 (sysctl -w kernel.unprivileged_userns_clone=1)"
        )
    if _read_int(proc_sys / "kernel/apparmor_restrict_unprivileged_userns", 0) == 1:
        hints.append(
            "kernel.apparmor_restrict_unprivileged_userns=1 (Ubuntu's AppArmor) takes capabilities from new user namespaces; "
            "set it to 0, or give the Python interpreter an AppArmor profile with 'userns,'"
        )
    seccomp = next((line.split()[1] for line in _lines(status) if line.startswith("Seccomp:")), "0")
    if seccomp != "0":
        hints.append(
            "this process runs under a seccomp filter (a container's, e.g. Docker's default profile refuses unshare "
            "and mount); run the container with a profile allowing them (docker run --security-opt seccomp=unconfined)"
        )
    return hints


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


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
    python = os.path.realpath(sys.executable)
    if not python.startswith(sys.base_prefix + os.sep):
        raise SandboxUnavailableError(f"the interpreter {python} lies outside its installation {sys.base_prefix}")
    root = tempfile.mkdtemp(prefix="megatron-rl-sandbox-")  # the mount point, inside the sandbox's namespace only
    os.chmod(root, 0o755)  # reachable by the set-up process once it has left root for a uid of its own
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
            "root_uid_base": UID_BASE,
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
        "disk_files": limits.disk_files,
        "open_files": limits.open_files,
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
        hints = namespace_hints()
        causes = f"; {'; '.join(hints)}" if hints else ""
        raise SandboxUnavailableError(f"cannot set up the sandbox: {errors[0]}{causes}")
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
    return stderr_stop_reason(stderr)


def stderr_stop_reason(stderr: str) -> StopReason | None:
    """The limit named by the last line of ``stderr`` that reports one (``memory``, ``processes``, ``file_size``,
    ``disk``; see the module docstring), None when no line does. Meaningful for code that failed only."""
    for line in reversed(stderr.splitlines()):  # the last report wins; a fork bomb's children interleave theirs
        for prefix, reason in _STDERR_STOPS:
            if line.startswith(prefix):
                return reason
    return None
