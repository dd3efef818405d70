"""The sandbox's own processes; :func:`megatron_rl.tools.sandbox.run_sandboxed` runs this file as ``python -I -S``.

Standard library only, and no import of the package: it runs by path, before any namespace exists.
Its job arrives as one JSON object on stdin (the keys :func:`main` reads). No step needs root: every
privileged step happens inside a user namespace this process creates. Three processes:

1. this one (in the host's namespaces, as the caller's uid): dies with its parent
   (``PR_SET_PDEATHSIG``), unshares the user, mount, network, PID, IPC and UTS namespaces and maps
   ``SANDBOX_UID`` inside to its own uid outside (as root: a helper it forked maps ``SANDBOX_UID`` to
   ``job["root_uid_base"]`` + its pid, a uid of this sandbox's own, and root to root for the set-up),
   forks 2 and waits for it, at most the wall limit plus ``BACKSTOP_S`` (the code cannot see or signal
   this process);
2. the namespace's PID 1 (with the namespace's capabilities, none outside it): dies with 1, builds
   the root (a tmpfs holding read-only bind mounts of ``job["binds"]``, four device files,
   ``/main.py`` and a private ``/tmp`` tmpfs), ``pivot_root``\\s into it and detaches the host's tree,
   forks 3, reaps every process of the namespace, and reports 3's end; when it exits the kernel kills
   whatever 3 left running;
3. the code: limits (``setrlimit``), a new empty session keyring, uid and gid ``SANDBOX_UID``, every
   capability dropped (bounding, ambient, effective, permitted, inheritable), no new privileges, the seccomp filter of
   :func:`seccomp_program`, then ``exec`` of the interpreter on ``/main.py`` in ``/tmp``.

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
import struct
import sys
from collections.abc import Callable
from typing import Any, NoReturn

# mount(2) flags; statvfs's ST_* flags have the same values for the first five and the atime ones
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
LOCKED_MOUNT_FLAGS = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME | MS_RELATIME
"""Flags a bind in a user namespace must keep from its source (the kernel locks them: EPERM otherwise)."""
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 1, 24, 38, 22
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
SECCOMP_MODE_FILTER = 2
SANDBOX_UID = 1000
"""The code's uid and gid inside its user namespace, mapped to the uid and gid that created it."""
DEVICES = ("null", "zero", "random", "urandom")
NAMESPACES = os.CLONE_NEWUSER | os.CLONE_NEWNS | os.CLONE_NEWNET | os.CLONE_NEWPID | os.CLONE_NEWIPC | os.CLONE_NEWUTS
SETUP_PROCESSES = 2
"""Processes 1 and 2, which count in the code's ``RLIMIT_NPROC`` where they share its uid (a user's sandbox)."""
BACKSTOP_S = 5
"""Seconds past the wall limit after which process 1 ends the sandbox itself (the parent normally does it first)."""
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
"""The seccomp ``arch`` value of each machine; a syscall of any other ABI (i386 on x86_64) kills the process."""
X32_SYSCALL_BIT = 0x40000000
SYSCALLS: dict[str, dict[str, int]] = {
    "x86_64": {
        "socket": 41, "socketpair": 53, "clone": 56, "clone3": 435, "pivot_root": 155, "keyctl": 250,
        "capset": 126, "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "chroot": 161,
        "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "kexec_load": 246, "kexec_file_load": 320,
        "add_key": 248, "request_key": 249, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_by_handle_at": 304,
        "name_to_handle_at": 303, "init_module": 175, "finit_module": 313, "delete_module": 176,
        "memfd_create": 319, "memfd_secret": 447, "shmget": 29, "msgget": 68, "semget": 64, "mq_open": 240,
        "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "mount_setattr": 442, "syslog": 103, "acct": 163, "swapon": 167, "swapoff": 168, "reboot": 169,
        "quotactl": 179, "pidfd_getfd": 438, "process_madvise": 440, "kcmp": 312, "fanotify_init": 300,
    },
    "aarch64": {
        "socket": 198, "socketpair": 199, "clone": 220, "clone3": 435, "pivot_root": 41, "keyctl": 219,
        "capset": 91, "unshare": 97, "setns": 268, "mount": 40, "umount2": 39, "chroot": 51,
        "bpf": 280, "perf_event_open": 241, "userfaultfd": 282, "kexec_load": 104, "kexec_file_load": 294,
        "add_key": 217, "request_key": 218, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_by_handle_at": 265,
        "name_to_handle_at": 264, "init_module": 105, "finit_module": 273, "delete_module": 106,
        "memfd_create": 279, "memfd_secret": 447, "shmget": 194, "msgget": 186, "semget": 190, "mq_open": 180,
        "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "mount_setattr": 442, "syslog": 116, "acct": 89, "swapon": 224, "swapoff": 225, "reboot": 142,
        "quotactl": 60, "pidfd_getfd": 438, "process_madvise": 440, "kcmp": 272, "fanotify_init": 262,
    },
}  # fmt: skip
"""Syscall numbers by machine (from the kernel's ``unistd`` tables), for libc calls without a wrapper and the filter."""
DENIED_SYSCALLS = (
    *("unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen"),
    *("fsconfig", "fsmount", "fspick", "mount_setattr", "bpf", "perf_event_open", "userfaultfd", "kexec_load"),
    *("kexec_file_load", "keyctl", "add_key", "request_key", "ptrace", "process_vm_readv", "process_vm_writev"),
    *("pidfd_getfd", "process_madvise", "kcmp", "io_uring_setup", "io_uring_enter", "io_uring_register"),
    *("open_by_handle_at", "name_to_handle_at", "init_module", "finit_module", "delete_module", "syslog"),
    *("acct", "swapon", "swapoff", "reboot", "quotactl", "fanotify_init", "capset"),
    # memory that RLIMIT_AS does not count: memfd, SysV and POSIX IPC objects (Python needs none of them)
    *("memfd_create", "memfd_secret", "shmget", "msgget", "semget", "mq_open"),
)
"""Syscalls the code's filter refuses with EPERM."""
NAMESPACE_CLONE_FLAGS = 0x7E020000
"""``CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET``: refused in ``clone``'s flags."""
KEYCTL_JOIN_SESSION_KEYRING = 1
CAPABILITY_VERSION_3 = 0x20080522

_libc = ctypes.CDLL(None, use_errno=True)


def main() -> NoReturn:
    """Process 1: read the job, make the namespaces, run PID 1 in them and exit when it does (or past the wall)."""
    job = json.loads(sys.stdin.buffer.read())
    status_fd: int = job["status_fd"]
    os.umask(0o022)
    _step(status_fd, "die with the parent", lambda: _prctl(PR_SET_PDEATHSIG, signal.SIGKILL))
    if os.getppid() != job["parent_pid"]:
        os._exit(1)  # the parent died before the line above: nobody waits for this sandbox
    if os.geteuid() == 0:
        _step(status_fd, "leave root's groups", lambda: os.setgroups([]))
        map_ids = _mapper(status_fd, job["root_uid_base"] + os.getpid())
    else:
        map_ids = functools.partial(_map_own_ids, os.geteuid(), os.getegid())
        # RLIMIT_NPROC counts per uid of the namespace: this process and PID 1 share the code's uid here.
        job["processes"] += SETUP_PROCESSES
    _step(status_fd, "create the user namespace (with mount, network, PID, IPC and UTS)", _unshare)
    _step(status_fd, "map the sandbox's uid and gid", map_ids)
    lifeline, parent_end = os.pipe()  # PID 1 sees EOF when this process is gone
    pid = os.fork()
    if pid == 0:
        os.close(parent_end)
        _init(job, lifeline)
    os.close(lifeline)
    signal.signal(signal.SIGALRM, lambda *_: os._exit(1))  # the kernel then kills PID 1 and every process
    signal.alarm(int(job["wall_time_s"]) + BACKSTOP_S)
    os.waitpid(pid, 0)
    os._exit(0)


def _unshare() -> None:
    os.unshare(NAMESPACES)


def _map_own_ids(uid: int, gid: int) -> None:
    """Map ``SANDBOX_UID`` to ``uid`` and ``gid`` outside: the only mapping a user may write for itself."""
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{SANDBOX_UID} {uid} 1\n")
    _write("/proc/self/gid_map", f"{SANDBOX_UID} {gid} 1\n")


def _mapper(status_fd: int, uid: int) -> Callable[[], None]:
    """As root: fork a helper that stays outside and maps ``SANDBOX_UID`` to ``uid`` (a uid of this sandbox's own).

    Only a process with ``CAP_SETUID`` outside may map another uid than its own, so the helper writes
    this process's maps once it has unshared; the returned step tells it to and waits for it.
    """
    go_read, go_write = os.pipe()
    helper = os.fork()
    if helper == 0:
        os.close(go_write)
        if not os.read(go_read, 1):
            os._exit(1)  # process 1 failed before unsharing and has reported why
        parent = os.getppid()
        ids = f"0 0 1\n{SANDBOX_UID} {uid} 1\n"  # root stays root inside for the set-up: it owns the mount points
        for name in ("uid_map", "gid_map"):
            path = f"/proc/{parent}/{name}"
            _step(status_fd, f"write {path}", functools.partial(_write, path, ids))
        os._exit(0)
    os.close(go_read)

    def map_ids() -> None:
        os.write(go_write, b"1")
        os.close(go_write)
        _, status = os.waitpid(helper, 0)
        if status != 0:
            os._exit(1)  # the helper reported why

    return map_ids


def _init(job: dict[str, Any], lifeline: int) -> NoReturn:
    """PID 1 of the new namespaces: build the root, start the code, reap, report the code's end."""
    status_fd: int = job["status_fd"]
    _step(status_fd, "die with the parent (PID 1)", lambda: _prctl(PR_SET_PDEATHSIG, signal.SIGKILL))
    if select.select([lifeline], [], [], 0)[0]:
        os._exit(1)  # process 1 died before the line above
    # The code runs as this uid and may signal PID 1: a handler would let a signal through, so none is left.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _build_root(job)
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
    ids = f"uid={SANDBOX_UID},gid={SANDBOX_UID}"
    tmp_options = f"size={job['disk_bytes']},nr_inodes={job['disk_files']},mode=700,{ids}"
    _step(
        fd,
        "mount the private /tmp",
        lambda: _mount("sandbox-tmp", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, tmp_options),
    )
    _step(fd, "remount the root read-only", lambda: _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID))
    os.chdir(root)
    _step(fd, "pivot_root into the sandbox root", _pivot_root_here)
    _step(fd, "detach the host's root", lambda: _check(_libc.umount2(b".", MNT_DETACH)))
    os.chdir("/")


def _pivot_root_here() -> None:
    _check(_libc.syscall(_syscall_number("pivot_root"), b".", b"."))


def _bind(source: str, target: str, *, read_only: bool) -> None:
    """Bind ``source`` (a directory or a file) at ``target``, creating the mount point; then read-only if asked."""
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    _mount(source, target, None, MS_BIND)
    locked = os.statvfs(target).f_flag & LOCKED_MOUNT_FLAGS
    flags = MS_BIND | MS_REMOUNT | MS_NOSUID | locked | (MS_RDONLY | MS_NODEV if read_only else MS_NOEXEC)
    _mount(None, target, None, flags)  # a bind takes its flags only when remounted


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as file:
        file.write(text)


def _run_code(job: dict[str, Any]) -> NoReturn:
    """Process 3: limits, no capabilities, the seccomp filter, then the interpreter on ``/main.py``."""
    fd = job["status_fd"]
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.chdir("/tmp")
    for limit, values in _rlimits(job).items():
        _step(fd, f"set resource limit {limit}", functools.partial(resource.setrlimit, limit, values))
    _step(fd, "leave the parent's session keyring", _new_session_keyring)
    _step(fd, "empty the bounding and ambient capability sets", _drop_inheritable_capabilities)
    _step(fd, f"take uid {SANDBOX_UID}", functools.partial(_set_ids, SANDBOX_UID))
    _step(fd, "drop every capability", _clear_capabilities)
    _step(fd, "forbid new privileges", lambda: _prctl(PR_SET_NO_NEW_PRIVS, 1))
    _step(fd, "install the seccomp filter", _install_seccomp_filter)
    os.set_inheritable(fd, False)
    python = job["python"]
    environment = {"PATH": os.path.dirname(python), "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
    try:
        os.execve(python, [python, "-I", "-B", "/main.py"], environment)
    except OSError as exc:
        _fail(fd, f"exec {python}: {exc}")


def _set_ids(uid: int) -> None:
    """Take ``uid`` and its gid (outside: root's sandbox uid, or the user's own, which it already is)."""
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _rlimits(job: dict[str, Any]) -> dict[int, tuple[int, int]]:
    """The code's resource limits: each bound of the job, and none of the rest (core dumps, locked memory, queues)."""
    return {
        resource.RLIMIT_CPU: (job["cpu_time_s"], job["cpu_time_s"] + 1),  # SIGXCPU first, SIGKILL a second later
        resource.RLIMIT_AS: (job["memory_bytes"],) * 2,
        resource.RLIMIT_NPROC: (job["processes"],) * 2,
        resource.RLIMIT_FSIZE: (job["file_size_bytes"],) * 2,
        resource.RLIMIT_NOFILE: (job["open_files"],) * 2,
        resource.RLIMIT_CORE: (0, 0),
        resource.RLIMIT_MEMLOCK: (0, 0),
        resource.RLIMIT_MSGQUEUE: (0, 0),
        resource.RLIMIT_SIGPENDING: (job["open_files"],) * 2,
    }


def _new_session_keyring() -> None:
    """Join a new, empty session keyring: the inherited one is the caller's (keys are not namespaced)."""
    if _libc.syscall(_syscall_number("keyctl"), KEYCTL_JOIN_SESSION_KEYRING, None) == -1:
        error = ctypes.get_errno()
        # No key support, or a seccomp filter refusing keyctl: it refuses the code too, so no key is reachable.
        if error not in (errno.ENOSYS, errno.EPERM):
            raise OSError(error, os.strerror(error))


def _drop_inheritable_capabilities() -> None:
    """Empty the bounding and ambient sets: no exec can give a capability back."""
    for capability in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) == -1 and ctypes.get_errno() != errno.EINVAL:
            _check(-1)  # EINVAL: past the kernel's last capability
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)


def _clear_capabilities() -> None:
    """Empty the effective, permitted and inheritable sets (a process may always drop its own)."""
    header = struct.pack("=Ii", CAPABILITY_VERSION_3, 0)
    data = bytes(24)  # two {effective, permitted, inheritable} words, all zero
    _check(_libc.syscall(_syscall_number("capset"), header, data))


def seccomp_program(machine: str) -> list[tuple[int, int, int, int]]:
    """The code's seccomp filter as classic BPF ``(code, jt, jf, k)`` instructions, for ``machine``.

    Another ABI's syscall (i386 or x32 on x86_64) is refused; each of :data:`DENIED_SYSCALLS` fails
    with EPERM; ``clone3`` fails with ENOSYS (libc then falls back to ``clone``, whose flags the filter
    reads); ``clone`` with a namespace flag fails with EPERM; ``socket`` and ``socketpair`` of any family
    but ``AF_UNIX`` fail with EAFNOSUPPORT; every other syscall is allowed.
    """
    numbers = SYSCALLS[machine]
    load, jeq, jset, jge, ret = 0x20, 0x15, 0x45, 0x35, 0x06
    allow, kill = 0x7FFF0000, 0x80000000
    nr, arch, arg0 = 0, 4, 16  # offsets in struct seccomp_data (arg0's low 32 bits on a little-endian machine)

    def fail(error: int) -> tuple[int, int, int, int]:
        return (ret, 0, 0, 0x00050000 | error)

    program = [(load, 0, 0, arch), (jeq, 1, 0, AUDIT_ARCH[machine]), (ret, 0, 0, kill), (load, 0, 0, nr)]
    if machine == "x86_64":
        program += [(jge, 0, 1, X32_SYSCALL_BIT), fail(errno.ENOSYS)]
    for name in DENIED_SYSCALLS:
        program += [(jeq, 0, 1, numbers[name]), fail(errno.EPERM)]
    program += [(jeq, 0, 1, numbers["clone3"]), fail(errno.ENOSYS)]
    program += [
        (jeq, 1, 0, numbers["socket"]),
        (jeq, 0, 4, numbers["socketpair"]),
        (load, 0, 0, arg0),
        (jeq, 0, 1, 1),  # AF_UNIX
        (ret, 0, 0, allow),
        fail(errno.EAFNOSUPPORT),
        (jeq, 0, 3, numbers["clone"]),
        (load, 0, 0, arg0),
        (jset, 0, 1, NAMESPACE_CLONE_FLAGS),
        fail(errno.EPERM),
        (ret, 0, 0, allow),
    ]
    return program


def _install_seccomp_filter() -> None:
    program = seccomp_program(platform.machine())
    instructions = b"".join(struct.pack("=HBBI", *instruction) for instruction in program)
    buffer = ctypes.create_string_buffer(instructions, len(instructions))
    fprog = struct.pack("=HxxxxxxQ", len(program), ctypes.addressof(buffer))
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, fprog, 0, 0))


def _syscall_number(name: str) -> int:
    """The number of syscall ``name`` on this machine; OSError(ENOSYS) on a machine without a table."""
    numbers = SYSCALLS.get(platform.machine())
    if numbers is None:
        raise OSError(errno.ENOSYS, f"no syscall numbers known for machine {platform.machine()!r}")
    return numbers[name]


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
