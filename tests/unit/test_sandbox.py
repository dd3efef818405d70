"""The sandbox, for real: each attempt to reach the network or the host's files fails, each limit stops what it
bounds and says so, the host is unaffected, and ordinary code works.

Every test runs real code through :func:`run_sandboxed` on this machine (as root here; Linux user
namespaces); the first asserts the machine can make one. Hostile code, and the sandbox run by an
unprivileged user: tests/unit/test_sandbox_hostile.py.
"""

from __future__ import annotations

import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatron_rl.tools.sandbox import (
    UID_BASE,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailableError,
    run_sandboxed,
    sandbox_problem,
)
from megatron_rl.tools.sandbox_init import SANDBOX_UID, SYSCALLS

REPO = Path(__file__).resolve().parents[2]
SMALL = SandboxLimits(cpu_time_s=1, wall_time_s=10, memory_bytes=256 << 20, processes=8, output_bytes=1000)


def _run(code: str, limits: SandboxLimits = SMALL) -> SandboxResult:
    return run_sandboxed(textwrap.dedent(code), limits)


def _sandbox_processes() -> list[int]:
    """Host pids of processes running as a sandbox uid (none should outlive their run)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            uid_line = next(line for line in (entry / "status").read_text().splitlines() if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if int(uid_line.split()[1]) >= UID_BASE:
            found.append(int(entry.name))
    return found


@pytest.fixture
def host_server() -> Iterator[socket.socket]:
    """A TCP server listening on the host's 127.0.0.1, accepting nothing until asked."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        yield server


@pytest.fixture
def secrets(tmp_path: Path) -> Iterator[list[Path]]:
    """Files like a run's key: one in a run folder beside the test (under /tmp) and one under /work."""
    (tmp_path / "run").mkdir()
    beside = tmp_path / "run" / "engine_api_key"
    beside.write_text("SECRET-beside")
    runs = REPO / "runs"
    runs.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=runs) as work_run:
        under_work = Path(work_run) / "engine_api_key"
        under_work.write_text("SECRET-work")
        yield [beside, under_work]


def test_this_machine_can_sandbox_code() -> None:
    assert sandbox_problem() is None


def test_ordinary_code_runs_and_uses_its_private_directory() -> None:
    result = _run(
        """
        import fractions, json, math, os
        with open("notes.txt", "w") as f:
            f.write(json.dumps({"pi": round(math.pi, 5), "third": str(fractions.Fraction(1, 3))}))
        print(open("/tmp/notes.txt").read(), os.getcwd(), sum(range(101)))
        """
    )
    assert result == SandboxResult('{"pi": 3.14159, "third": "1/3"} /tmp 5050\n', "", 0, None)


def test_a_failing_program_is_not_a_stopped_one() -> None:
    result = _run("import sys\nprint('partial')\nsys.exit(3)")
    assert (result.stdout, result.exit_code, result.stopped) == ("partial\n", 3, None)
    raised = _run("raise KeyError('k')")
    assert raised.exit_code == 1 and raised.stopped is None and raised.stderr.endswith("KeyError: 'k'\n")


def test_no_network_neither_the_hosts_loopback_nor_outside(host_server: socket.socket) -> None:
    port = host_server.getsockname()[1]
    result = _run(
        f"""
        import socket
        for address in [("127.0.0.1", {port}), ("1.1.1.1", 53), ("8.8.8.8", 443)]:
            try:
                socket.create_connection(address, timeout=2)
                print(address, "connected")
            except OSError as exc:
                print(address, exc.errno)
        try:
            socket.if_nameindex()
        except OSError as exc:
            print("if_nameindex", exc.errno)
        """
    )
    no_family = 97  # EAFNOSUPPORT: the seccomp filter allows AF_UNIX sockets only
    assert result.stdout.splitlines() == [
        f"('127.0.0.1', {port}) {no_family}",
        f"('1.1.1.1', 53) {no_family}",
        f"('8.8.8.8', 443) {no_family}",
        f"if_nameindex {no_family}",  # it asks netlink
    ], result.stderr
    with pytest.raises(BlockingIOError):
        host_server.accept()


def test_the_hosts_files_are_invisible(secrets: list[Path]) -> None:
    result = _run(
        f"""
        import os
        for path in {[str(path) for path in secrets]!r} + ["/work/main/pyproject.toml", "/root/.bashrc", "/etc/passwd"]:
            try:
                print(open(path).read())
            except OSError as exc:
                print(path, type(exc).__name__)
        print(sorted(os.listdir("/")), sorted(os.listdir("/tmp")), os.path.exists("/proc/1"), os.path.exists("/work"))
        """
    )
    lines = result.stdout.splitlines()
    assert "SECRET" not in result.stdout and result.exit_code == 0, result.stderr
    assert lines[:5] == [f"{path} FileNotFoundError" for path in [*map(str, secrets), "/work/main/pyproject.toml"]] + [
        "/root/.bashrc FileNotFoundError",
        "/etc/passwd FileNotFoundError",
    ]
    top_level = {path.split("/")[1] for path in ("/lib", "/lib64", "/usr/lib", sys.base_prefix) if Path(path).exists()}
    assert lines[5] == f"{sorted(top_level | {'dev', 'etc', 'main.py', 'tmp'})} [] False False"


def test_writing_outside_the_private_directory_fails_and_the_host_sees_nothing(tmp_path: Path) -> None:
    name = f"sandbox-escape-{os.getpid()}"
    targets = [f"/{name}", f"/usr/lib/{name}", f"{sys.base_prefix}/{name}", f"{REPO}/{name}", f"/root/{name}"]
    result = _run(
        f"""
        for path in {targets!r}:
            try:
                open(path, "w").write("escaped")
                print(path, "written")
            except OSError as exc:
                print(path, type(exc).__name__, exc.errno)
        open("/tmp/{name}", "w").write("inside")
        print(open("/tmp/{name}").read())
        """
    )
    read_only, missing = 30, 2  # EROFS; ENOENT (no /work, no /root/... inside)
    assert result.stdout.splitlines() == [
        f"/{name} OSError {read_only}",
        f"/usr/lib/{name} OSError {read_only}",
        f"{sys.base_prefix}/{name} OSError {read_only}",
        f"{REPO}/{name} FileNotFoundError {missing}",
        f"/root/{name} OSError {read_only}",
        "inside",
    ], result.stderr
    for path in [*targets, f"/tmp/{name}"]:
        assert not Path(path).exists(), path


def test_the_code_runs_unprivileged() -> None:
    capget = f"{SYSCALLS[platform.machine()]['capset'] - 1}"  # capget precedes capset on both machines
    result = _run(
        f"""
        import ctypes, os, struct
        header, data = ctypes.create_string_buffer(struct.pack("=Ii", 0x20080522, 0)), ctypes.create_string_buffer(24)
        ctypes.CDLL(None).syscall({capget}, header, data)
        print(os.getuid(), os.getgid(), os.getgroups(), os.getpid(), set(data.raw))
        """
    )
    # its uid, no groups, PID 2 of its own PID namespace, no capability
    assert result.stdout == f"{SANDBOX_UID} {SANDBOX_UID} [] 2 {{0}}\n", result.stderr


def test_the_code_reaches_no_keyring() -> None:
    get_session_keyring = f"{SYSCALLS[platform.machine()]['keyctl']}, 0, -3, 0"  # KEYCTL_GET_KEYRING_ID
    result = _run(
        f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint(libc.syscall({get_session_keyring}), ctypes.get_errno())"
    )
    assert result.stdout == "-1 1\n"  # EPERM: the seccomp filter refuses keyctl


def test_an_infinite_loop_is_stopped_by_cpu_time() -> None:
    result = _run("while True:\n    pass")
    assert (result.stopped, result.exit_code) == ("cpu_time", -signal.SIGXCPU)


def test_sleeping_past_the_wall_limit_is_stopped_by_wall_time() -> None:
    start = time.monotonic()
    result = _run("import time\nprint('started', flush=True)\ntime.sleep(600)", SandboxLimits(wall_time_s=1))
    assert (result.stdout, result.exit_code, result.stopped) == ("started\n", None, "wall_time")
    assert time.monotonic() - start < 10
    assert _sandbox_processes() == []


def test_memory_exhaustion_is_stopped_by_memory() -> None:
    at_once = _run("x = bytearray(1 << 30)")
    growing = _run("chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))")
    for result in (at_once, growing):
        assert (result.stopped, result.exit_code) == ("memory", 1) and result.stderr.endswith("MemoryError\n")


def test_a_fork_bomb_is_stopped_by_processes_and_leaves_nothing_behind() -> None:
    result = _run("import os\nwhile True:\n    os.fork()", SandboxLimits(processes=8))
    assert result.stopped == "processes" and "BlockingIOError: [Errno 11]" in result.stderr
    assert _sandbox_processes() == []
    assert subprocess.run(["true"], check=False).returncode == 0  # the host can still start processes


def test_the_process_count_is_limited() -> None:
    result = _run(
        """
        import os, time
        children = 0
        while True:
            try:
                pid = os.fork()
            except BlockingIOError:
                break
            if pid == 0:
                time.sleep(600)
            children += 1
        print(children)
        """
    )
    assert result.stdout == f"{SMALL.processes - 1}\n"  # the code's own process is one of the 8
    assert _sandbox_processes() == []  # its sleeping children ended with it


def test_huge_output_is_cut_and_stopped_by_output() -> None:
    printed = _run("print('o' * 10**6)")
    assert (printed.stopped, printed.stdout) == ("output", "o" * 1000)
    endless = _run("import sys\nwhile True:\n    sys.stderr.write('e')")
    assert (endless.stopped, endless.stderr) == ("output", "e" * 1000)


def test_file_size_and_disk_are_bounded() -> None:
    limits = SandboxLimits(file_size_bytes=1 << 20, disk_bytes=4 << 20)
    big_file = _run("open('big', 'wb').write(b'x' * (2 << 20))", limits)
    assert big_file.stopped == "file_size" and big_file.stderr.endswith("File too large\n")
    full_disk = _run("for i in range(8):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))", limits)
    assert full_disk.stopped == "disk" and full_disk.stderr.endswith("No space left on device\n")


def test_the_sandbox_dies_with_the_process_that_runs_it() -> None:
    runner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from megatron_rl.tools import run_sandboxed; run_sandboxed('import time; time.sleep(600)')",
        ],
        cwd=REPO,
    )
    deadline = time.monotonic() + 30
    while not _sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _sandbox_processes(), "the sandboxed code started"
    runner.kill()
    runner.wait()
    while _sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _sandbox_processes() == []


def test_a_failed_set_up_step_raises_naming_it_and_runs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import megatron_rl.tools.sandbox as sandbox

    monkeypatch.setattr(sandbox, "_binds", lambda: [sys.base_prefix, "/no/such/library/dir"])
    with pytest.raises(SandboxUnavailableError, match=r"bind /no/such/library/dir read-only: \[Errno 2\]"):
        sandbox.run_sandboxed("open('/tmp/ran', 'w')")


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="SandboxLimits.memory_bytes must be positive, got 0"):
        SandboxLimits(memory_bytes=0)


def test_the_settings_that_refuse_user_namespaces_are_named_with_their_fix(tmp_path: Path) -> None:
    from megatron_rl.tools.sandbox import namespace_hints

    for name, value in [("user/max_user_namespaces", "0"), ("kernel/apparmor_restrict_unprivileged_userns", "1")]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(value + "\n")
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nSeccomp:\t2\n")
    hints = namespace_hints(tmp_path, status)
    assert [hint.split(" ", 1)[0] for hint in hints] == [
        "user.max_user_namespaces=0",
        "kernel.apparmor_restrict_unprivileged_userns=1",
        "this",
    ]
    assert "sysctl -w user.max_user_namespaces=10000" in hints[0] and "seccomp=unconfined" in hints[2]
    assert namespace_hints(tmp_path / "none", tmp_path / "none") == []
