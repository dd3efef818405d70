"""The README's default-job command runs as written."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_default_job_command_runs_and_says_what_it_ran() -> None:
    result = subprocess.run(
        [str(ROOT / "launch" / "run.sh"), "train.prompts_per_step=4"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "the RL job is not built yet: running recipe validation and data preparation" in result.stdout
    assert "# first step: 4 prompts x 8 samples" in result.stdout
