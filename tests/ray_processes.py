"""Ray clusters a test starts with ``ray start`` (Ray's own processes, as on a real cluster) and their end."""

from __future__ import annotations

import contextlib
import json
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

RAY = str(Path(sys.executable).with_name("ray"))
"""The ``ray`` command of this environment."""
JOIN_TIMEOUT_S = 180
PROBE_TIMEOUT_S = 40


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 a moment ago."""
    sockets = [socket.create_server(("127.0.0.1", 0)) for _ in range(count)]
    try:
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def node_ports() -> list[str]:
    """Every port a raylet would otherwise take at a default (shared with any other Ray on the machine)."""
    manager, objects, agent, agent_grpc, runtime_env, metrics = free_ports(6)
    low = 20000 + secrets.randbelow(400) * 100  # a worker port range of 100
    return [
        f"--node-manager-port={manager}",
        f"--object-manager-port={objects}",
        f"--dashboard-agent-listen-port={agent}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--runtime-env-agent-port={runtime_env}",
        f"--metrics-export-port={metrics}",
        f"--min-worker-port={low}",
        f"--max-worker-port={low + 99}",
    ]


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL ``process`` and every process below it (by pid: only what this test started)."""
    try:
        tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for member in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.send_signal(signal.SIGKILL)
    process.wait(30)


def ray_probe(env: dict[str, str], code: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh Python after ``ray.init`` joins the cluster ``env`` names (TimeoutExpired after
    ``timeout_s``)."""
    script = "import ray; ray.init(logging_level='ERROR', log_to_driver=False)\n" + code
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout_s)


def wait_for_nodes(env: dict[str, str], count: int, timeout_s: float = JOIN_TIMEOUT_S) -> None:
    """Return once the cluster ``env`` names has ``count`` live nodes; fail the test (AssertionError) after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    probe = "import json; print(json.dumps(sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'])))"
    while True:
        try:
            result = ray_probe(env, probe, timeout_s=PROBE_TIMEOUT_S)
            seen = f"{result.stdout} {result.stderr[-2000:]}"
            if result.returncode == 0 and len(json.loads(result.stdout.strip().splitlines()[-1])) == count:
                return
        except subprocess.TimeoutExpired:  # a join that hangs (once seen in CI: 120 s at a fresh head) is retried
            seen = f"ray.init did not return within {PROBE_TIMEOUT_S} s"
        assert time.monotonic() < deadline, f"{count} Ray node(s) not up: {seen}"
        time.sleep(1)
