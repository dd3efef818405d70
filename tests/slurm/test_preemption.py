"""Pre-emption on a real (one-node) Slurm cluster: signalled, the job saves, exits 0, is requeued and resumes.

`slurm/train.sbatch` runs the tiny DAPO recipe for 40 steps (about 0.2 s each here: enough that the
signal lands while steps remain). Once step 2 is in its metrics, the batch script gets SIGTERM
(`scancel --batch --signal=TERM`, what Slurm sends at pre-emption; the driver, joined to the script's Ray at
`RAY_ADDRESS`, keeps its handler through `ray.init`). SIGUSR1 (`--signal=B:USR1@N` before a time limit) takes
the same path: the script forwards both (`tests/unit/test_forward_signals.py`) and the driver handles both
alike. The driver finishes its step, saves a checkpoint and exits 0; the script requeues the job,
which starts again, resumes from `latest` and finishes. Its final weights (the Hugging Face export
of the last checkpoint) equal, bit for bit, those of the same run trained without interruption.
A command that finishes its work despite the signal (a signal in the last step) is not requeued.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.slurm.local_slurm import local_slurm, missing_requirements

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "recipes/tiny_moe_cpu_dapo.yaml"
STEPS = 40
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements())),
]


def _overrides(directory: Path) -> list[str]:
    return [
        f"train.steps={STEPS}",
        "train.prompts_per_step=4",
        "rollout.n_samples_per_prompt=8",
        "validation.interval=0",
        "checkpoint.interval=0",
        "checkpoint.export_hf=true",
        f"checkpoint.dir={directory / 'checkpoints'}",
        f"logging.dir={directory / 'logs'}",
        "logging.sinks=[console,jsonl]",
    ]


def _final_weights(directory: Path) -> dict:
    latest = directory / "checkpoints" / (directory / "checkpoints" / "latest").read_text().strip()
    tensors = {}
    for file in sorted((latest / "hf").glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _logged_steps(directory: Path) -> list[int]:
    path = directory / "logs" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def _job_state(env: dict[str, str], job: str) -> dict[str, str]:
    shown = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True, text=True, check=True)
    return dict(re.findall(r"(\w+)=(\S*)", shown.stdout))


@pytest.fixture(scope="module")
def uninterrupted_weights(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The final weights of the run trained without interruption, outside Slurm."""
    directory = tmp_path_factory.mktemp("reference")
    reference = subprocess.run(
        [str(ROOT / ".venv/bin/megatron-rl"), "train", RECIPE, *_overrides(directory)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    return _final_weights(directory)


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    with local_slurm(tmp_path_factory.mktemp("slurm")) as env:
        yield os.environ | env


@pytest.mark.full
def test_a_signalled_job_saves_exits_requeues_and_ends_with_the_uninterrupted_weights(
    slurm_env: dict[str, str], uninterrupted_weights: dict, tmp_path: Path
) -> None:
    signal_name = "TERM"
    job_dir, output = tmp_path / "job", tmp_path / "job.out"
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--output={output}", "slurm/train.sbatch", RECIPE, *_overrides(job_dir)],
        cwd=ROOT,
        env=slurm_env,
        capture_output=True,
        text=True,
        check=True,
    )
    job = submitted.stdout.strip().split(";")[0]

    deadline = time.monotonic() + 600
    while max(_logged_steps(job_dir), default=0) < 2:
        assert time.monotonic() < deadline, f"step 2 never logged; job state {_job_state(slurm_env, job)}"
        time.sleep(1)
    subprocess.run(["scancel", "--batch", f"--signal={signal_name}", job], env=slurm_env, check=True)

    while (state := _job_state(slurm_env, job))["JobState"] != "COMPLETED":
        assert state["JobState"] in ("RUNNING", "PENDING", "REQUEUED", "COMPLETING"), (
            state,
            output.read_text()[-3000:] if output.exists() else "",
        )
        assert time.monotonic() < deadline, f"the job did not complete: {state}"
        time.sleep(2)

    log = output.read_text()
    assert state["Restarts"] == "1", log[-3000:]
    stopped = re.search(
        rf"# stopped for SIG{signal_name} after step (\d+) of {STEPS}: the checkpoint of step \1 is saved", log
    )
    assert stopped, log[-3000:]
    assert 2 <= int(stopped.group(1)) < STEPS
    assert f"[ray_cluster] the command stopped after SIG{signal_name}; requeueing job" in log
    assert f"job {job}, start 2:" in log
    assert _logged_steps(job_dir) == list(range(1, STEPS + 1))

    final, expected = _final_weights(job_dir), uninterrupted_weights
    assert final.keys() == expected.keys()
    differing = [name for name in expected if not final[name].equal(expected[name])]
    assert not differing, f"weights differ from the uninterrupted run: {differing[:5]}"


def test_a_command_that_finishes_despite_the_signal_is_not_requeued(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """Without the driver's stop notice in MEGATRON_RL_STOPPED_EARLY_FILE, an exit 0 after SIGUSR1 ends the job."""
    ready, output = tmp_path / "ready", tmp_path / "job.out"
    finishes_anyway = (
        "import signal, sys, time; from pathlib import Path; "
        "signal.signal(signal.SIGUSR1, lambda *_: sys.exit(0)); "
        f"Path({str(ready)!r}).touch(); time.sleep(300); sys.exit(1)"
    )
    submitted = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"--output={output}",
            "slurm/ray_job.sbatch",
            str(ROOT / ".venv/bin/python"),
            "-c",
            finishes_anyway,
        ],
        cwd=ROOT,
        env=slurm_env | {"REQUEUE_AFTER_SIGNAL": "1"},
        capture_output=True,
        text=True,
        check=True,
    )
    job = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 300
    while not ready.exists():
        assert time.monotonic() < deadline, f"the command never started; job state {_job_state(slurm_env, job)}"
        time.sleep(1)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm_env, check=True)
    while (state := _job_state(slurm_env, job))["JobState"] != "COMPLETED":
        assert state["JobState"] in ("RUNNING", "COMPLETING"), (state, output.read_text()[-3000:])
        assert time.monotonic() < deadline, f"the job did not complete: {state}"
        time.sleep(1)
    log = output.read_text()
    assert state["Restarts"] == "0", log[-3000:]
    assert f"[ray_cluster] the command finished its work despite SIGUSR1; not requeueing job {job}" in log
