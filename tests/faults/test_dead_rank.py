"""A trainer rank killed mid-run: the job fails at once naming the rank and its node; started again, it resumes.

The tiny DAPO run (2 trainer ranks) checkpoints every 2 steps. Once step 3 is logged, one rank's
process gets SIGKILL. The driver must stop within a bounded time with the rank and node named (not
wait for the collective timeout), and the same command must resume from the last checkpoint and end
with the weights of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
STEPS = 5
FAIL_WITHIN_S = 60
pytestmark = pytest.mark.slow


def _command(run_dir: Path) -> list[str]:
    command = [sys.executable, "-m", "megatron_rl.cli", "train", str(ROOT / "recipes" / "tiny_moe_cpu_dapo.yaml")]
    return command + [
        f"train.steps={STEPS}",
        "train.prompts_per_step=4",
        "rollout.n_samples_per_prompt=8",
        "algorithm.dynamic_sampling.gen_batch_prompts=16",
        "validation.interval=0",
        "checkpoint.interval=2",
        "checkpoint.export_hf=true",
        f"checkpoint.dir={run_dir / 'checkpoints'}",
        f"logging.dir={run_dir / 'logs'}",
        "logging.sinks=[jsonl]",
    ]


def _env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "logs" / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, IndexError, ValueError):
        return 0


def _rank_pids(driver: int) -> list[int]:
    """The trainer rank processes of the driver process ``driver``: workers of the raylet it started.

    (A rank's own child processes, such as checkpoint writers, carry the same title one level lower.)
    """
    found = subprocess.run(["pgrep", "-f", "ray::_RankHost"], capture_output=True, text=True, check=False)
    return [pid for pid in map(int, found.stdout.split()) if _parent(_parent(pid)) == driver]


def _final_weights(run_dir: Path) -> dict:
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    return {k: v for file in sorted((latest / "hf").glob("*.safetensors")) for k, v in load_file(file).items()}


def test_a_killed_rank_fails_the_run_fast_and_a_restart_resumes_exactly(tmp_path: Path) -> None:
    reference, faulty = tmp_path / "reference", tmp_path / "faulty"
    done = subprocess.run(_command(reference), env=_env(), capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]

    run = subprocess.Popen(_command(faulty), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while max(_steps(faulty), default=0) < 3:
            assert run.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 3"
            time.sleep(0.5)
        pids = _rank_pids(run.pid)
        assert len(pids) == 2, pids
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        try:
            _, stderr = run.communicate(timeout=FAIL_WITHIN_S)
        except subprocess.TimeoutExpired:
            run.kill()
            _, stderr = run.communicate()
            pytest.fail(f"the driver still ran {FAIL_WITHIN_S} s after the kill:\n{stderr[-3000:]}")
        assert time.monotonic() - killed < FAIL_WITHIN_S  # measured: 4.3 s on the 2-core box
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode != 0
    assert re.search(r"error: trainer rank [01] on node [\d.]+ died in \w+", stderr), stderr[-3000:]

    restarted = subprocess.run(_command(faulty), env=_env(), capture_output=True, text=True, timeout=600, check=False)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert _steps(faulty) == list(range(1, STEPS + 1))  # the steps after the checkpoint were redone, once each
    final, expected = _final_weights(faulty), _final_weights(reference)
    assert final.keys() == expected.keys()
    assert [name for name in expected if not final[name].equal(expected[name])] == []
