"""What the tiny run exposes: every socket it listens on is on 127.0.0.1, and its keys reach no file.

One run of the tiny DAPO recipe (2 steps, validation, a checkpoint with a Hugging Face export, the
JSONL, TensorBoard and offline W&B sinks) with a known engine key (``MEGATRON_RL_ENGINE_API_KEY``)
and a W&B API key in its environment. While it runs, the test lists the listening TCP sockets of
the driver and every process below it (Ray's GCS, raylet, agents and workers, the trainer ranks,
the reference engine, reward workers) and their command lines. Asserted: every listening socket
is on 127.0.0.1 (the engine's HTTP port among them), no command line holds the engine key, and
neither key appears in the run's output, in any file under the run's directory (logs, engine
log, metrics, TensorBoard and W&B files, checkpoints, prepared data) or under its Ray session
directory (Ray's logs).
"""

from __future__ import annotations

import re
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.e2e.tiny_runs import TWO_STEPS, run_env, train_command

LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1"}
pytestmark = pytest.mark.slow


def _command(run_dir: Path) -> list[str]:
    return train_command(
        [
            *TWO_STEPS,
            "checkpoint.export_hf=true",
            f"checkpoint.dir={run_dir / 'checkpoints'}",
            f"logging.dir={run_dir / 'logs'}",
            "logging.sinks=[jsonl,tensorboard,wandb]",
            "logging.wandb_project=access-test",
        ]
    )


def _offline_wandb_env(home: Path) -> dict[str, str]:
    """W&B offline with its files in ``home`` and a server address that refuses connections."""
    return {
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / "cache"),
        "XDG_CONFIG_HOME": str(home / "config"),
        "NETRC": str(home / "netrc"),
        "WANDB_MODE": "offline",
        "WANDB_BASE_URL": "http://127.0.0.1:9",
        "WANDB_SILENT": "true",
        "WANDB_ERROR_REPORTING": "false",
        "WANDB__DISABLE_STATS": "true",
    }


class _Watcher(threading.Thread):
    """Records the listening sockets and command lines of ``pid`` and its descendants until stopped.

    Every distinct command line a process showed is kept: an exiting process's ``/proc/PID/cmdline``
    reads empty for a moment before it becomes a zombie, which must not erase what was seen.
    """

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.listening: dict[tuple[str, int], str] = {}
        self.command_lines: set[str] = set()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                processes = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for process in processes:
                try:
                    if command_line := " ".join(process.cmdline()):
                        self.command_lines.add(command_line)
                    for connection in process.net_connections(kind="inet"):
                        if connection.status == psutil.CONN_LISTEN:
                            self.listening[connection.laddr.ip, connection.laddr.port] = process.name()
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
            time.sleep(0.2)


def _files_holding(directory: Path, needles: list[bytes]) -> list[str]:
    found = []
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            try:
                data = path.read_bytes()
            except OSError:
                continue
            found += [f"{path} holds key {i}" for i, needle in enumerate(needles) if needle in data]
    return found


@pytest.fixture
def ray_dir() -> Iterator[Path]:
    """A temporary root for the run's Ray session, short (Ray's socket paths live under it), removed afterwards."""
    directory = Path(tempfile.mkdtemp(prefix="mrl-ray-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def test_the_tiny_run_listens_on_loopback_only_and_its_keys_reach_no_file(tmp_path: Path, ray_dir: Path) -> None:
    engine_key, wandb_key = f"engine-{secrets.token_hex(16)}", secrets.token_hex(20)
    run_dir = tmp_path / "run"
    env = run_env() | _offline_wandb_env(tmp_path / "home")
    env |= {
        "MEGATRON_RL_ENGINE_API_KEY": engine_key,
        "WANDB_API_KEY": wandb_key,
        "RAY_TMPDIR": str(ray_dir),
    }
    env.pop("RAY_ADDRESS", None)
    run = subprocess.Popen(
        _command(run_dir), cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    watcher = _Watcher(run.pid)
    watcher.start()
    try:
        stdout, stderr = run.communicate(timeout=600)
    finally:
        watcher.done.set()
        if run.poll() is None:
            run.kill()
    watcher.join(10)
    assert run.returncode == 0, stderr[-4000:]

    engine = re.search(r"engines: reference0 at ([\d.]+):(\d+)", stdout)
    assert engine and engine.group(1) == "127.0.0.1", stdout
    assert "# network: loopback (127.0.0.1); trainer ranks on 127.0.0.1 x2" in stdout
    assert ("127.0.0.1", int(engine.group(2))) in watcher.listening  # the engine was seen listening
    elsewhere = {address: name for address, name in watcher.listening.items() if address[0] not in LOOPBACK}
    assert elsewhere == {}, f"listening beyond loopback: {elsewhere}"
    assert len(watcher.listening) >= 5, watcher.listening  # Ray's servers, the trainer store, the engine, ...

    assert [line for line in watcher.command_lines if "megatron_rl.engines.reference.server" in line], "engine not seen"
    assert not [line for line in watcher.command_lines if engine_key in line]
    engine_log = (run_dir / "logs" / "reference0.log").read_text()
    assert "(API key required)" in engine_log

    needles = [engine_key.encode(), wandb_key.encode()]
    assert not [i for i, needle in enumerate(needles) if needle.decode() in stdout + stderr]
    assert (run_dir / "logs" / "wandb").is_dir() and (run_dir / "checkpoints" / "latest").is_file()
    assert _files_holding(tmp_path, needles) == []
    assert _files_holding(ray_dir, needles) == []
