"""The sandbox's own processes; :func:`megatron_rl.tools.sandbox.run_sandboxed` runs this file as ``python -I -S``.

Standard library only, and no import of the package: it runs by path, before any namespace exists.
Its job arrives as one JSON object on stdin (the keys :func:`main` reads). Three processes:

1. this one (as root, in the host's PID namespace): dies with its parent (``PR_SET_PDEATHSIG``),
   unshares the mount, network, PID, IPC and UTS namespaces, forks 2 and waits for it;
2. the namespace's PID 1 (root inside): dies with 1, builds the root (a tmpfs holding read-only
   bind mounts of ``job["binds"]``, four device files, ``/main.py`` and a private ``/tmp`` tmpfs),
   ``pivot_root``\\s into it and detaches the host's tree, forks 3, reaps every process of the
   namespace, and reports 3's end; when it exits the kernel kills whatever 3 left running;
3. the code: limits (``setrlimit``), a new empty session keyring, an unprivileged uid of its own, no
   new privileges, then ``exec`` of the interpreter on ``/main.py`` with ``/tmp`` as its working directory.

Reports go to ``job["status_fd"]``, one JSON object a line: ``{"error": "<step>: <why>"}`` when a
step of the set-up fails (nothing of the code has run), else ``{"exit_code": n}`` or ``{"signal": n}``
with ``"cpu_s"``, the CPU seconds the code's process used.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import os
import platform
import resource
import select
import signal
import sys
from collections.abc import Callable
from typing import Any, NoReturn

# mount(2) flags
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
PIVOT_ROOT_SYSCALL = {"x86_64": 155, "aarch64": 41}
"""``SYS_pivot_root`` by machine (glibc has no wrapper)."""
KEYCTL_SYSCALL = {"x86_64": 250, "aarch64": 219}
"""``SYS_keyctl`` by machine."""
KEYCTL_JOIN_SESSION_KEYRING = 1
DEVICES = ("null", "zero", "random", "urandom")
NAMESPACES = os.CLONE_NEWNS | os.CLONE_NEWNET | os.CLONE_NEWPID | os.CLONE_NEWIPC | os.CLONE_NEWUTS
BACKSTOP_S = 5
"""Seconds past the wall limit after which PID 1 ends the sandbox itself (the parent normally does it first)."""

_libc = ctypes.CDLL(None, use_errno=True)


def main() -> NoReturn:
    """Process 1: read the job, make the namespaces, run PID 1 in them and exit when it does."""
    job = json.loads(sys.stdin.buffer.read())
    status_fd: int = job["status_fd"]
    os.umask(0o022)
    _step(status_fd, "die with the parent", lambda: _prctl(PR_SET_PDEATHSIG, signal.SIGKILL))
    if os.getppid() != job["parent_pid"]:
        os._exit(1)  # the parent died before the line above: nobody waits for this sandbox
    _step(status_fd, "create the mount, network, PID, IPC and UTS namespaces", lambda: os.unshare(NAMESPACES))
    lifeline, parent_end = os.pipe()  # PID 1 sees EOF when this process is gone
    pid = os.fork()
    if pid == 0:
        os.close(parent_end)
        _init(job, lifeline)
    os.close(lifeline)
    os.waitpid(pid, 0)
    os._exit(0)


def _init(job: dict[str, Any], lifeline: int) -> NoReturn:
    """PID 1 of the new namespace: build the root, start the code, reap, report the code's end."""
    status_fd: int = job["status_fd"]
    _step(status_fd, "die with the parent (PID 1)", lambda: _prctl(PR_SET_PDEATHSIG, signal.SIGKILL))
    if select.select([lifeline], [], [], 0)[0]:
        os._exit(1)  # process 1 died before the line above
    _build_root(job)
    signal.signal(signal.SIGALRM, lambda *_: os._exit(1))
    signal.alarm(int(job["wall_time_s"]) + BACKSTOP_S)
    code_pid = os.fork()
    if code_pid == 0:
        os.close(lifeline)
        _run_code(job)
    while True:
        pid, status, usage = os.wait4(-1, 0)
        if pid == code_pid:
            report: dict[str, Any] = {"cpu_s": usage.ru_utime + usage.ru_stime}
            if os.WIFSIGNALED(status):
                report["signal"] = os.WTERMSIG(status)
            else:
                report["exit_code"] = os.WEXITSTATUS(status)
            _report(status_fd, report)
            os._exit(0)


def _build_root(job: dict[str, Any]) -> None:
    """Mount the sandbox's root at ``job["root"]`` and make it this namespace's ``/`` (the module docstring)."""
    fd, root = job["status_fd"], job["root"]
    _step(fd, "make every mount private", lambda: _mount(None, "/", None, MS_REC | MS_PRIVATE))
    root_options = f"size={len(job['code'].encode()) + (1 << 20)},mode=755"  # the mount points and /main.py
    _step(fd, f"mount a tmpfs root at {root}", lambda: _mount("sandbox", root, "tmpfs", MS_NOSUID, root_options))
    for path in job["binds"]:
        _step(fd, f"bind {path} read-only", functools.partial(_bind, path, root + path, read_only=True))
    for link, target in job["links"]:
        _step(fd, f"link {link} -> {target}", functools.partial(os.symlink, target, root + link))
    _step(fd, "make /dev", lambda: os.mkdir(root + "/dev"))
    for device in DEVICES:
        path = f"/dev/{device}"
        _step(fd, f"bind {path}", functools.partial(_bind, path, root + path, read_only=False))
    _step(fd, "write /main.py", lambda: _write(root + "/main.py", job["code"]))
    _step(fd, "make /tmp", lambda: os.mkdir(root + "/tmp"))
    uid, disk = job["uid"], job["disk_bytes"]
    tmp_options = f"size={disk},mode=700,uid={uid},gid={uid}"
    _step(
        fd,
        "mount the private /tmp",
        lambda: _mount("sandbox-tmp", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, tmp_options),
    )
    _step(fd, "remount the root read-only", lambda: _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID))
    os.chdir(root)
    number = PIVOT_ROOT_SYSCALL.get(platform.machine())
    if number is None:
        _fail(fd, f"pivot_root: no syscall number known for machine {platform.machine()!r}")
    _step(fd, "pivot_root into the sandbox root", lambda: _check(_libc.syscall(number, b".", b".")))
    _step(fd, "detach the host's root", lambda: _check(_libc.umount2(b".", MNT_DETACH)))
    os.chdir("/")


def _bind(source: str, target: str, *, read_only: bool) -> None:
    """Bind ``source`` (a directory or a file) at ``target``, creating the mount point; then read-only if asked."""
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    _mount(source, target, None, MS_BIND)
    flags = MS_BIND | MS_REMOUNT | MS_NOSUID | (MS_RDONLY | MS_NODEV if read_only else MS_NOEXEC)
    _mount(None, target, None, flags)  # a bind takes its flags only when remounted


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as file:
        file.write(text)


def _run_code(job: dict[str, Any]) -> NoReturn:
    """Process 3: limits, an unprivileged uid, then the interpreter on ``/main.py``."""
    fd, uid = job["status_fd"], job["uid"]
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.chdir("/tmp")
    limits = {
        resource.RLIMIT_CPU: (job["cpu_time_s"], job["cpu_time_s"] + 1),  # SIGXCPU first, SIGKILL a second later
        resource.RLIMIT_AS: (job["memory_bytes"],) * 2,
        resource.RLIMIT_NPROC: (job["processes"],) * 2,
        resource.RLIMIT_FSIZE: (job["file_size_bytes"],) * 2,
        resource.RLIMIT_CORE: (0, 0),
    }
    for limit, values in limits.items():
        _step(fd, f"set resource limit {limit}", functools.partial(resource.setrlimit, limit, values))
    _step(fd, "leave the parent's session keyring", _new_session_keyring)
    _step(fd, f"drop privileges to uid {uid}", lambda: _drop_privileges(uid))
    _step(fd, "forbid new privileges", lambda: _prctl(PR_SET_NO_NEW_PRIVS, 1))
    os.set_inheritable(fd, False)
    python = job["python"]
    environment = {"PATH": os.path.dirname(python), "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
    try:
        os.execve(python, [python, "-I", "-B", "/main.py"], environment)
    except OSError as exc:
        _fail(fd, f"exec {python}: {exc}")


def _new_session_keyring() -> None:
    """Join a new, empty session keyring: the inherited one is root's (keys are not namespaced)."""
    number = KEYCTL_SYSCALL.get(platform.machine())
    if number is None:
        raise OSError(errno.ENOSYS, f"no keyctl syscall number known for machine {platform.machine()!r}")
    if _libc.syscall(number, KEYCTL_JOIN_SESSION_KEYRING, None) == -1:
        error = ctypes.get_errno()
        # No key support, or a seccomp filter refusing keyctl: it refuses the code too, so no key is reachable.
        if error not in (errno.ENOSYS, errno.EPERM):
            raise OSError(error, os.strerror(error))


def _drop_privileges(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encoded = [None if value is None else value.encode() for value in (source, target, fstype, data)]
    _check(_libc.mount(encoded[0], encoded[1], encoded[2], flags, encoded[3]))


def _prctl(option: int, value: int) -> None:
    _check(_libc.prctl(option, value, 0, 0, 0))


def _check(result: int) -> None:
    """Raise the OSError of a libc call that returned -1."""
    if result == -1:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))


def _step(fd: int, what: str, action: Callable[[], object]) -> None:
    """Run one set-up step; when it fails, report ``what`` and why, and exit (the code never runs)."""
    try:
        action()
    except OSError as exc:
        _fail(fd, f"{what}: {exc}")


def _fail(fd: int, message: str) -> NoReturn:
    _report(fd, {"error": message})
    os._exit(1)


def _report(fd: int, report: dict[str, Any]) -> None:
    os.write(fd, (json.dumps(report) + "\n").encode())


if __name__ == "__main__":
    main()
