"""A closed pipe ends a printing command quietly, and never kills a command that talks to engines.

The run held out from the suite (the tiny SGLang recipe, 150 steps) died at step 125 with exit status 141: the CLI
had put SIGPIPE at its default action for every command, so a write to a kept-alive connection the engine had just
closed killed ``train`` instead of raising the BrokenPipeError that ``engines/http_engine.py`` resends on.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from megatron_rl.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_validate_into_a_closed_pipe_ends_quietly() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader (`head`) is already gone when validate prints
    try:
        result = subprocess.run(
            [sys.executable, "-m", "megatron_rl.cli", "validate", "recipes/tiny_moe_cpu_dapo.yaml"],
            cwd=ROOT,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            check=False,
        )
    finally:
        os.close(write_end)
    assert result.returncode == -signal.SIGPIPE, result.stderr[-2000:]
    assert result.stderr == ""


def test_train_keeps_python_raising_broken_pipe_on_a_socket_the_peer_closed(tmp_path: Path) -> None:
    assert main(["train", str(tmp_path / "absent.yaml")]) == 1  # refused: no recipe, after the CLI's set-up
    assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN  # Python's own: writes raise instead of killing
    ours, engines = socket.socketpair()
    engines.close()
    try:
        ours.sendall(b"x" * 65536)
        ours.sendall(b"x" * 65536)
    except BrokenPipeError:
        pass
    else:
        raise AssertionError("a write to a closed peer did not raise BrokenPipeError")
    finally:
        ours.close()


def test_validate_in_process_gives_the_callers_pipe_handler_back() -> None:
    assert main(["validate", str(ROOT / "recipes" / "tiny_moe_cpu_dapo.yaml")]) == 0
    assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN


def _probe(command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.closed_pipe_probe", command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_train_survives_an_engine_closing_its_kept_alive_connection_at_the_moment_of_a_write() -> None:
    """The held-out run's death, reproduced in the command's own process: the engine closes the connection as the
    next request is written, the write meets EPIPE; `train` keeps Python's SIGPIPE handling, so the client sees
    BrokenPipeError and resends on a new connection. The same exchange under `validate` (SIGPIPE at its default
    action, for `| head`) kills the process, as every command did before the fix."""
    survived = _probe("train")
    assert survived.returncode == 0 and "answered twice" in survived.stdout, survived.stderr[-2000:]
    killed = _probe("validate")
    assert killed.returncode == -signal.SIGPIPE, (killed.returncode, killed.stderr[-2000:])
