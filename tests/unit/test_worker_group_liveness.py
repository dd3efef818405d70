"""Whether a rank's process still runs, read from /proc while the process may be exiting."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.orchestration.worker_group import _running


def test_a_live_process_runs_and_an_exited_one_does_not() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert _running(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not _running(child.pid)
    assert _running(os.getpid())


def test_a_process_gone_between_open_and_read_is_not_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel answers ESRCH to a read of /proc/<pid>/stat whose process exited after the open: a slurm job's
    preflight ended on that ProcessLookupError while shutting its probes down."""

    def exited_meanwhile(self: Path, *args: object, **kwargs: object) -> str:
        raise ProcessLookupError(3, "No such process")

    monkeypatch.setattr(Path, "read_text", exited_meanwhile)
    assert not _running(os.getpid())
