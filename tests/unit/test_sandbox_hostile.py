"""Hostile code against the sandbox, judged from the host's side: listeners that see nothing, memory measured
on the host, host files, secrets and processes untouched, nothing left behind; and the same sandbox run by an
unprivileged user (created here with useradd; CI runs as root).

A case whose effect the host cannot observe (a refused ``bpf`` or ``mount``) is judged by the errno the
kernel returned to the code and by the run ending normally.
"""

from __future__ import annotations

import errno
import os
import platform
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatron_rl.tools.sandbox import UID_BASE, SandboxLimits, SandboxResult, memory_bound, run_sandboxed
from megatron_rl.tools.sandbox_init import SYSCALLS

REPO = Path(__file__).resolve().parents[2]
LIMITS = SandboxLimits(cpu_time_s=5, wall_time_s=20, memory_bytes=128 << 20, processes=4, output_bytes=4000)
NR = SYSCALLS.get(platform.machine(), {})
pytestmark = pytest.mark.skipif(not NR, reason=f"no syscall table for {platform.machine()}")

SYSCALL_PRELUDE = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
def call(number, *args):
    result = libc.syscall(number, *args)
    return errno.errorcode.get(ctypes.get_errno(), "?") if result == -1 else f"returned {result}"
"""


def _run(code: str, limits: SandboxLimits = LIMITS) -> SandboxResult:
    return run_sandboxed(textwrap.dedent(code), limits)


def _uids_processes(uids: range | set[int]) -> list[int]:
    """Host pids of processes whose real uid is in ``uids``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            line = next(line for line in (entry / "status").read_text().splitlines() if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if int(line.split()[1]) in uids:
            found.append(int(entry.name))
    return found


SANDBOX_UIDS = range(UID_BASE, 1 << 31)


def _pss(pids: list[int]) -> int:
    """Bytes of proportional set size of ``pids`` (shared pages split among their mappers), from the host."""
    total = 0
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
        except OSError:
            continue
        total += sum(int(line.split()[1]) << 10 for line in lines if line.startswith("Pss:"))
    return total


def _peak_memory_while(code: str, limits: SandboxLimits) -> tuple[SandboxResult, int]:
    """Run ``code`` and sample the sandbox's processes' PSS on the host until it ends; the result and the peak."""
    box: list[SandboxResult] = []
    runner = threading.Thread(target=lambda: box.append(_run(code, limits)))
    runner.start()
    peak = 0
    while runner.is_alive():
        peak = max(peak, _pss(_uids_processes(SANDBOX_UIDS)))
        time.sleep(0.05)
    runner.join()
    return box[0], peak


@pytest.fixture(autouse=True)
def _nothing_left_behind() -> Iterator[None]:
    """Every case: no sandbox process outlives its run, no sandbox root stays in the host's /tmp."""
    roots_before = set(Path(tempfile.gettempdir()).glob("megatron-rl-sandbox-*"))
    yield
    deadline = time.monotonic() + 10
    while _uids_processes(SANDBOX_UIDS) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _uids_processes(SANDBOX_UIDS) == []
    assert set(Path(tempfile.gettempdir()).glob("megatron-rl-sandbox-*")) <= roots_before


@pytest.fixture
def tcp_listener() -> Iterator[socket.socket]:
    with socket.socket() as server:
        server.bind(("0.0.0.0", 0))
        server.listen()
        server.setblocking(False)
        yield server


@pytest.fixture
def udp_listener() -> Iterator[socket.socket]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server:
        server.bind(("0.0.0.0", 0))
        server.setblocking(False)
        yield server


def _saw_nothing(server: socket.socket) -> bool:
    try:
        server.accept() if server.type == socket.SOCK_STREAM else server.recv(100)
    except BlockingIOError:
        return True
    return False


def _host_address() -> str:
    """An address of this host other than loopback (the route's source; no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 9))
            return str(probe.getsockname()[0])
        except OSError:
            pytest.skip("this host has no non-loopback IPv4 route")


# --- the network ------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["loopback", "host_address"])
def test_tcp_to_a_host_listener_arrives_nowhere(tcp_listener: socket.socket, where: str) -> None:
    address = "127.0.0.1" if where == "loopback" else _host_address()
    port = tcp_listener.getsockname()[1]
    result = _run(
        f"import socket\ntry:\n    socket.create_connection(('{address}', {port}), timeout=2)\nexcept OSError as e:\n    print(e.errno)"
    )
    time.sleep(0.2)
    assert _saw_nothing(tcp_listener) and result.stdout == f"{errno.EAFNOSUPPORT}\n"


def test_udp_to_a_host_listener_arrives_nowhere(udp_listener: socket.socket) -> None:
    port = udp_listener.getsockname()[1]
    result = _run(
        f"import socket\ntry:\n    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', {port}))\nexcept OSError as e:\n    print(e.errno)"
    )
    time.sleep(0.2)
    assert _saw_nothing(udp_listener) and result.stdout == f"{errno.EAFNOSUPPORT}\n"


def test_dns_resolves_nothing() -> None:
    result = _run(
        "import socket\ntry:\n    print(socket.getaddrinfo('example.com', 80))\nexcept OSError as e:\n    print(type(e).__name__)"
    )
    assert result.stdout == "gaierror\n", result.stderr


def test_a_unix_socket_at_a_host_path_is_unreachable(tmp_path: Path) -> None:
    path = tmp_path / "host.sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        server.listen()
        server.setblocking(False)
        result = _run(
            f"import socket\ntry:\n    socket.socket(socket.AF_UNIX).connect('{path}')\nexcept OSError as e:\n    print(e.errno)"
        )
        assert _saw_nothing(server) and result.stdout == f"{errno.ENOENT}\n"


def test_an_abstract_unix_socket_of_the_host_is_unreachable() -> None:
    name = f"\0megatron-rl-hostile-{os.getpid()}"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(name)
        server.listen()
        server.setblocking(False)
        result = _run(
            f"import socket\ntry:\n    socket.socket(socket.AF_UNIX).connect({name!r})\nexcept OSError as e:\n    print(e.errno)"
        )
        assert _saw_nothing(server) and result.stdout == f"{errno.ECONNREFUSED}\n"  # another network namespace


@pytest.mark.parametrize(
    ("family", "kind"),
    [
        ("AF_VSOCK", "SOCK_STREAM"),
        ("AF_NETLINK", "SOCK_RAW"),
        ("AF_PACKET", "SOCK_RAW"),
        ("AF_INET", "SOCK_RAW"),
        ("AF_INET6", "SOCK_STREAM"),
        ("AF_INET", "SOCK_DGRAM"),
    ],
)
def test_no_socket_but_unix_can_be_made(family: str, kind: str) -> None:
    result = _run(
        f"import socket\ntry:\n    socket.socket(socket.{family}, socket.{kind})\nexcept OSError as e:\n    print(e.errno)"
    )
    assert result.stdout == f"{errno.EAFNOSUPPORT}\n", result.stderr


def test_vsock_through_a_raw_syscall_and_through_socketpair_is_refused() -> None:
    result = _run(SYSCALL_PRELUDE + f"print(call({NR['socket']}, 40, 1, 0), call({NR['socketpair']}, 40, 1, 0, None))")
    assert result.stdout == "EAFNOSUPPORT EAFNOSUPPORT\n", result.stderr


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the x32 ABI exists on x86_64 only")
def test_the_x32_syscall_numbers_do_not_bypass_the_filter() -> None:
    result = _run(SYSCALL_PRELUDE + f"print(call({0x40000000 + NR['socket']}, 40, 1, 0))")
    assert result.stdout == "ENOSYS\n", result.stderr


# --- memory -----------------------------------------------------------------------------------------

HOLD = """
import os, time
def grab():
    chunks = []
    try:
        while True:
            chunks.append(bytearray(8 << 20))  # touched: zero-filled
    except MemoryError:
        pass
    return chunks
"""


def test_many_processes_hold_at_most_the_stated_total_measured_on_the_host() -> None:
    code = HOLD + textwrap.dedent(
        """
        for _ in range(8):
            try:
                if os.fork() == 0:
                    held = grab()
                    time.sleep(3)
                    os._exit(0)
            except BlockingIOError:
                break
        held = grab()
        time.sleep(3)
        print(len(held))
        """
    )
    result, peak = _peak_memory_while(code, LIMITS)
    bound = memory_bound(LIMITS)
    assert result.exit_code == 0, result.stderr
    assert peak <= bound.parts["processes"], (peak, bound)
    assert peak > LIMITS.memory_bytes, "the measurement sees what the processes hold"


def test_anonymous_shared_memory_counts_in_the_address_space() -> None:
    code = textwrap.dedent(
        """
        import mmap
        try:
            mmap.mmap(-1, 512 << 20, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        except OSError as e:
            print(e.errno)
        """
    )
    result, peak = _peak_memory_while(code, LIMITS)
    assert result.stdout == f"{errno.ENOMEM}\n" and peak < LIMITS.memory_bytes


def test_memfd_is_refused_and_holds_nothing() -> None:
    code = "import os\ntry:\n    fd = os.memfd_create('x')\n    os.ftruncate(fd, 1 << 30)\nexcept OSError as e:\n    print(e.errno)"
    result, peak = _peak_memory_while(code, LIMITS)
    assert result.stdout == f"{errno.EPERM}\n" and peak < LIMITS.memory_bytes


@pytest.mark.parametrize(
    ("name", "args"), [("shmget", "0, 1 << 30, 0o1600"), ("msgget", "0, 0o1600"), ("semget", "0, 1000, 0o1600")]
)
def test_sysv_ipc_objects_are_refused(name: str, args: str) -> None:
    result = _run(SYSCALL_PRELUDE + f"print(call({NR[name]}, {args}))")
    assert result.stdout == "EPERM\n", result.stderr


def test_posix_shared_memory_and_message_queues_are_unavailable() -> None:
    code = SYSCALL_PRELUDE + textwrap.dedent(
        f"""
        from multiprocessing import shared_memory
        try:
            shared_memory.SharedMemory(create=True, size=1 << 30)
        except OSError as e:
            print(type(e).__name__)
        print(call({NR["mq_open"]}, b"/q", os.O_CREAT | os.O_RDWR, 0o600, None))
        """
    )
    result = _run(code)
    assert result.stdout == "FileNotFoundError\nEPERM\n", result.stderr  # no /dev/shm; mq_open filtered


def test_the_tmpfs_holds_at_most_its_size_and_its_files() -> None:
    limits = SandboxLimits(disk_bytes=8 << 20, disk_files=64, file_size_bytes=64 << 20)
    code = textwrap.dedent(
        """
        import os
        written = 0
        try:
            with open("big", "wb") as f:
                while True:
                    f.write(b"x" * (1 << 20))
                    f.flush()
                    written += 1
        except OSError as e:
            print(written, e.errno)
        os.remove("big")
        made = 0
        try:
            while True:
                open(f"f{made}", "w").close()
                made += 1
        except OSError as e:
            print(made, e.errno)
        """
    )
    result = _run(code, limits)
    sizes, files = result.stdout.splitlines()
    assert int(sizes.split()[0]) <= 8 and sizes.split()[1] == str(errno.ENOSPC), result.stderr
    assert int(files.split()[0]) <= 64 and files.split()[1] == str(errno.ENOSPC)


def test_file_descriptors_cannot_be_hoarded() -> None:
    code = "import os\nfds = []\ntry:\n    while True:\n        fds.extend(os.pipe())\nexcept OSError as e:\n    print(len(fds) <= 64, e.errno)"
    result = _run(code)
    assert result.stdout == f"True {errno.EMFILE}\n", result.stderr


def test_threads_count_as_processes() -> None:
    code = textwrap.dedent(
        """
        import threading, time
        started = 0
        try:
            while True:
                threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
                started += 1
        except RuntimeError:
            print(started)
        """
    )
    assert _run(code).stdout == f"{LIMITS.processes - 1}\n"


# --- host files and secrets -------------------------------------------------------------------------


def test_etc_shadow_and_the_tests_own_files_are_unreadable(tmp_path: Path) -> None:
    secret = tmp_path / "key"
    secret.write_text("SECRET-file")
    code = f"for p in ['/etc/shadow', '{secret}', '/proc/1/environ', '/sys/kernel']:\n    try:\n        print(open(p).read())\n    except OSError as e:\n        print(e.errno)"
    result = _run(code)
    assert "SECRET" not in result.stdout and result.stdout == f"{errno.ENOENT}\n" * 4, result.stdout


def test_environment_variables_of_the_host_do_not_reach_the_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGATRON_RL_TEST_SECRET", "SECRET-env")
    result = _run(
        "import os\nprint(sorted(os.environ))\ntry:\n    open('/proc/self/environ').read()\nexcept OSError as e:\n    print(e.errno)"
    )
    assert "SECRET" not in result.stdout and "MEGATRON_RL_TEST_SECRET" not in result.stdout
    assert result.stdout.splitlines()[1] == str(errno.ENOENT)


def test_inherited_descriptors_of_the_host_are_closed(tmp_path: Path) -> None:
    secret = tmp_path / "key"
    secret.write_text("SECRET-fd")
    fd = os.open(secret, os.O_RDONLY)
    os.set_inheritable(fd, True)
    try:
        code = "import os\nfor fd in range(3, 1024):\n    try:\n        print(os.read(fd, 100))\n    except OSError:\n        pass"
        result = _run(code)
    finally:
        os.close(fd)
    assert "SECRET" not in result.stdout and result.stdout == ""


def test_a_symlink_does_not_lead_out_of_the_root() -> None:
    result = _run(
        "import os\nos.symlink('/etc', 'etc')\ntry:\n    print(open('etc/shadow').read())\nexcept OSError as e:\n    print(e.errno)"
    )
    assert result.stdout == f"{errno.ENOENT}\n"


def test_open_by_handle_is_refused() -> None:
    result = _run(
        SYSCALL_PRELUDE
        + f"print(call({NR['open_by_handle_at']}, -100, None, 0), call({NR['name_to_handle_at']}, -100, b'/', None, None, 0))"
    )
    assert result.stdout == "EPERM EPERM\n"


# --- processes and privileges -----------------------------------------------------------------------


@pytest.fixture
def host_sleeper() -> Iterator[subprocess.Popen[bytes]]:
    sleeper = subprocess.Popen(["sleep", "600"])
    yield sleeper
    sleeper.kill()
    sleeper.wait()


def test_host_processes_are_invisible_and_unkillable(host_sleeper: subprocess.Popen[bytes]) -> None:
    code = f"import os, signal\ntry:\n    os.kill({host_sleeper.pid}, signal.SIGKILL)\nexcept OSError as e:\n    print(e.errno)\nprint(os.path.exists('/proc'))\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError as e:\n    print(e.errno)"
    result = _run(code)
    assert host_sleeper.poll() is None and result.stdout.startswith(f"{errno.ESRCH}\nFalse\n")


def test_ptrace_and_process_memory_calls_are_refused(host_sleeper: subprocess.Popen[bytes]) -> None:
    pid = host_sleeper.pid
    code = (
        SYSCALL_PRELUDE
        + f"print(call({NR['ptrace']}, 16, {pid}, 0, 0), call({NR['ptrace']}, 16, 1, 0, 0), call({NR['process_vm_readv']}, 1, None, 0, None, 0, 0), call({NR['pidfd_getfd']}, 0, 0, 0))"
    )
    result = _run(code)
    assert result.stdout == "EPERM EPERM EPERM EPERM\n" and host_sleeper.poll() is None


def test_setuid_gives_nothing() -> None:
    code = "import os\nfor f in (os.setuid, os.setgid):\n    try:\n        f(0)\n    except OSError as e:\n        print(e.errno)\nprint(os.getuid())"
    result = _run(code)
    assert result.stdout == f"{errno.EPERM}\n{errno.EPERM}\n1000\n"


@pytest.mark.parametrize("flag", ["CLONE_NEWUSER", "CLONE_NEWNS", "CLONE_NEWNET", "CLONE_NEWPID"])
def test_no_nested_namespace_by_unshare_or_clone(flag: str) -> None:
    code = (
        SYSCALL_PRELUDE
        + f"print(call({NR['unshare']}, os.{flag}), call({NR['clone']}, os.{flag} | 17, None, None, None, None), call({NR['clone3']}, None, 0))"
    )
    result = _run(code)
    assert result.stdout == "EPERM EPERM ENOSYS\n", result.stderr


def test_ordinary_fork_threads_and_subprocesses_still_work() -> None:
    code = "import os, threading, subprocess, sys\nt = threading.Thread(target=print, args=('thread',))\nt.start(); t.join()\nprint(subprocess.run([sys.executable, '-c', 'print(1)'], capture_output=True, text=True).stdout.strip())\nr, w = __import__('socket').socketpair()\nw.send(b'unix'); print(r.recv(4).decode())"
    result = _run(code)
    assert result.stdout == "thread\n1\nunix\n", result.stderr


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("mount", "b'none', b'/tmp', b'tmpfs', 0, None"),
        ("umount2", "b'/usr/lib', 2"),
        ("pivot_root", "b'/tmp', b'/tmp'"),
        ("chroot", "b'/tmp'"),
        ("setns", "0, 0"),
        ("fsopen", "b'tmpfs', 0"),
        ("open_tree", "-100, b'/', 1"),
        ("init_module", "None, 0, b''"),
        ("finit_module", "0, b'', 0"),
        ("delete_module", "b'ext4', 0"),
        ("kexec_load", "0, 0, None, 0"),
        ("bpf", "0, None, 0"),
        ("perf_event_open", "None, 0, -1, -1, 0"),
        ("userfaultfd", "0"),
        ("io_uring_setup", "8, None"),
        ("keyctl", "0, -3, 0"),
        ("add_key", "b'user', b'k', b'v', 1, -3"),
        ("request_key", "b'user', b'k', None, 0"),
        ("memfd_secret", "0"),
        ("syslog", "3, None, 0"),
    ],
)
def test_privileged_and_kernel_attack_surface_calls_are_refused(name: str, args: str) -> None:
    result = _run(SYSCALL_PRELUDE + f"print(call({NR[name]}, {args}))")
    assert result.stdout == "EPERM\n", result.stderr


def test_signals_to_the_namespaces_init_do_not_break_the_sandbox() -> None:
    result = _run(
        "import os, signal\nfor s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM, signal.SIGKILL):\n    try:\n        os.kill(1, s)\n    except PermissionError:\n        pass\nprint('alive')"
    )
    assert (result.stdout, result.exit_code) == ("alive\n", 0)


# --- leftovers --------------------------------------------------------------------------------------


def test_a_daemon_does_not_outlive_the_run() -> None:
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(600)\n    os._exit(0)\nprint('spawned')"
    assert _run(code).stdout == "spawned\n"  # the autouse fixture checks that no sandbox process remains


def test_files_written_inside_are_gone_from_the_host() -> None:
    marker = f"hostile-{os.getpid()}"
    _run(f"open('/tmp/{marker}', 'w').write('x')")
    assert not Path(f"/tmp/{marker}").exists() and not Path(f"{REPO}/{marker}").exists()


# --- an unprivileged user ---------------------------------------------------------------------------

USER = "megatron-rl-sbx"
HARNESS = """
set -e
mount --make-rprivate /
if [ "$(stat -c %a /root)" = 700 ]; then  # a Python installed under /root: make only it reachable
    d=$(mktemp -d)
    mount --bind /root "$d"
    mount -t tmpfs -o mode=755 tmpfs /root
    for entry in "$d"/.pyenv "$d"/.local; do
        [ -e "$entry" ] && mkdir -p "/root/${entry##*/}" && mount --bind "$entry" "/root/${entry##*/}"
    done
fi
cd "$REPO"
exec runuser -u "$SANDBOX_USER" -- "$@"
"""
AS_USER_PROBE = """
import os, socket, sys, threading, time
sys.path.insert(0, os.getcwd())
from megatron_rl.tools import python, run_sandboxed, sandbox_problem
from megatron_rl.tools.sandbox import SandboxLimits
print("uid", os.getuid())
print("problem", sandbox_problem())
print("tool", python({"code": "print(6 * 7)"}, {}).strip())
port = int(sys.argv[1])
print("tcp", run_sandboxed(f"import socket\\ntry:\\n    socket.create_connection(('127.0.0.1', {port}))\\nexcept OSError as e:\\n    print(e.errno)").stdout.strip())
print("vsock", run_sandboxed("import socket\\ntry:\\n    socket.socket(40, 1)\\nexcept OSError as e:\\n    print(e.errno)").stdout.strip())
print("memfd", run_sandboxed("import os\\ntry:\\n    os.memfd_create('x')\\nexcept OSError as e:\\n    print(e.errno)").stdout.strip())
print("shadow", run_sandboxed("import os\\nprint(os.path.exists('/etc/shadow'), os.path.exists('/work'))").stdout.strip())
signals = "import os\\nfor s in (2, 14, 15, 9):\\n    os.kill(1, s)\\nprint('alive')"  # PID 1 shares the code's uid here
print("init", run_sandboxed(signals).stdout.strip())
limits = SandboxLimits(processes=4, wall_time_s=15)
hold = "import os, time\\nn = 0\\nwhile True:\\n    try:\\n        pid = os.fork()\\n    except BlockingIOError:\\n        break\\n    if pid == 0:\\n        time.sleep(8)\\n        os._exit(0)\\n    n += 1\\nprint(n)\\ntime.sleep(8)"
bomb = threading.Thread(target=lambda: print("bomb", run_sandboxed(hold, limits).stdout.strip()))
bomb.start()
time.sleep(3)
print("beside", run_sandboxed(hold.replace("time.sleep(8)", "time.sleep(0)"), limits).stdout.strip())
bomb.join()
"""


@pytest.fixture(scope="module")
def sandbox_user() -> Iterator[str]:
    if os.geteuid() != 0 or not all(shutil.which(tool) for tool in ("useradd", "userdel", "runuser", "unshare")):
        pytest.skip("needs root and useradd, runuser and unshare to create and be an unprivileged user")
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER], check=True)
    yield USER
    subprocess.run(["userdel", USER], check=False)


def _as_user(user: str, *command: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``command`` as ``user`` from the repo (in a mount namespace of its own where the interpreter lies in /root)."""
    environment = {"PATH": os.environ["PATH"], "REPO": str(REPO), "SANDBOX_USER": user}
    return subprocess.run(
        ["unshare", "--mount", "sh", "-c", HARNESS, "harness", *command],
        capture_output=True,
        text=True,
        env=environment,
        timeout=timeout,
        check=False,
    )


def test_an_unprivileged_user_runs_the_sandbox_and_it_holds(sandbox_user: str, tcp_listener: socket.socket) -> None:
    uid = pwd.getpwnam(sandbox_user).pw_uid
    port = str(tcp_listener.getsockname()[1])
    result = _as_user(sandbox_user, sys.executable, "-c", AS_USER_PROBE, port)
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines == {
        "uid": str(uid),
        "problem": "None",
        "tool": "42",
        "tcp": str(errno.EAFNOSUPPORT),
        "vsock": str(errno.EAFNOSUPPORT),
        "memfd": str(errno.EPERM),
        "shadow": "False False",
        "init": "alive",
        "bomb": "3",  # its own 4 processes (the code and 3 children) while holding them
        "beside": "3",  # a sandbox of the same user beside the fork bomb gets its own 4
    }, result.stderr
    assert _saw_nothing(tcp_listener)
    deadline = time.monotonic() + 10
    while _uids_processes({uid}) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _uids_processes({uid}) == []


def test_a_fork_bomb_in_one_sandbox_does_not_starve_another_run_as_root() -> None:
    limits = SandboxLimits(processes=4, wall_time_s=15)
    hold = "import os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n    except BlockingIOError:\n        break\n    if pid == 0:\n        time.sleep(6)\n        os._exit(0)\n    n += 1\nprint(n)\ntime.sleep(6)"
    results: list[SandboxResult] = []
    bomb = threading.Thread(target=lambda: results.append(run_sandboxed(hold, limits)))
    bomb.start()
    time.sleep(2)
    beside = run_sandboxed(hold.replace("time.sleep(6)", "time.sleep(0)"), limits)
    bomb.join()
    assert (results[0].stdout, beside.stdout) == ("3\n", "3\n")


# --- validate says whether the sandbox can run here -------------------------------------------------

TOOLS_RECIPES = ("recipes/qwen3_30b_a3b_dapo_tools.yaml", "recipes/tiny_moe_cpu_dapo_tools.yaml")
UNDER_A_FILTER = (
    "import sys; sys.path.insert(0, '.'); import ctypes; from megatron_rl.tools import sandbox_init; "
    "ctypes.CDLL(None).prctl(38, 1, 0, 0, 0); sandbox_init._install_seccomp_filter(); "  # as a container's would
    "from megatron_rl.cli import main; sys.exit(main(sys.argv[1:]))"
)


@pytest.mark.parametrize("recipe", TOOLS_RECIPES)
def test_validate_as_the_unprivileged_user_finds_the_sandbox_runs(sandbox_user: str, recipe: str) -> None:
    result = _as_user(sandbox_user, sys.executable, "-m", "megatron_rl.cli", "validate", recipe)
    assert result.returncode == 0 and "cannot run on this machine" not in result.stderr, result.stderr[-2000:]


def test_validate_names_why_the_sandbox_cannot_run_and_train_refuses_before_starting() -> None:
    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-c", UNDER_A_FILTER, *argv]
        return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)

    cause = (
        "rollout.tools: 'python' cannot run on this machine: cannot set up the sandbox: create the user namespace "
        "(with mount, network, PID, IPC and UTS): [Errno 1] Operation not permitted; this process runs under a "
        "seccomp filter"
    )
    with_python = (TOOLS_RECIPES[1], "rollout.tools=[python]")  # the tiny recipe's data files exist here
    plain = cli("validate", *with_python)
    assert plain.returncode == 0 and f"warning: {cause}" in plain.stderr, plain.stderr[-2000:]
    for argv in (("validate", "--strict", *with_python), ("train", *with_python)):
        refused = cli(*argv)
        assert refused.returncode == 1 and f"error: {cause}" in refused.stderr, refused.stderr[-2000:]
        assert "docker run --security-opt seccomp=unconfined" in refused.stderr
