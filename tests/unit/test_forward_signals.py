"""slurm/forward_signals.sh: the command's own exit status comes back, whenever it exits after a forwarded signal.

The shell runs `run_forwarding_signals` on a Python command that exits with a chosen status on SIGUSR1 or
SIGTERM. To make the race that once failed a CI run certain, the test wraps `forward` so that the shell
sleeps after passing the signal on: the command is gone before the shell looks again, as when a loaded
machine deschedules the shell at that moment. The wrapper changes timing only, not what is run.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_HARNESS = """
set -euo pipefail
source "$1/slurm/forward_signals.sh"
if [ "$2" = slow ]; then
    eval "$(declare -f forward | sed '1s/^forward/forward_now/')"
    forward() { forward_now "$@"; sleep 0.5; }
fi
shift 2
run_forwarding_signals "$@"
echo "status=$status signalled=$signalled"
"""


def _command(ready: Path, exit_status: int) -> list[str]:
    code = (
        "import signal, sys, time; from pathlib import Path\n"
        f"for s in (signal.SIGUSR1, signal.SIGTERM): signal.signal(s, lambda *_: sys.exit({exit_status}))\n"
        f"Path({str(ready)!r}).touch(); time.sleep(60); sys.exit(99)"
    )
    return ["python3", "-c", code]


def _signalled_run(tmp_path: Path, timing: str, exit_status: int, sent: signal.Signals) -> str:
    ready = tmp_path / "ready"
    shell = subprocess.Popen(
        ["bash", "-c", _HARNESS, "harness", str(ROOT), timing, *_command(ready, exit_status)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline and shell.poll() is None, shell.communicate()
        time.sleep(0.02)
    shell.send_signal(sent)
    out, err = shell.communicate(timeout=30)
    assert shell.returncode == 0, err
    return out


@pytest.mark.parametrize("timing", ["prompt", "slow"])
@pytest.mark.parametrize("exit_status", [0, 3])
def test_the_commands_own_status_comes_back_after_a_forwarded_signal(
    tmp_path: Path, timing: str, exit_status: int
) -> None:
    out = _signalled_run(tmp_path, timing, exit_status, signal.SIGUSR1)
    assert "[ray_cluster] SIGUSR1 received; forwarding it to the command" in out
    assert out.splitlines()[-1] == f"status={exit_status} signalled=USR1"


def test_sigterm_is_forwarded_and_named(tmp_path: Path) -> None:
    out = _signalled_run(tmp_path, "slow", 0, signal.SIGTERM)
    assert out.splitlines()[-1] == "status=0 signalled=TERM"


def test_an_unsignalled_command_returns_its_status_and_no_signal() -> None:
    shell = subprocess.run(
        ["bash", "-c", _HARNESS, "harness", str(ROOT), "prompt", "python3", "-c", "raise SystemExit(7)"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert shell.stdout.splitlines()[-1] == "status=7 signalled="
