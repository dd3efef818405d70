"""slurm/ray_job.sbatch on a real (one-node) Slurm cluster: Ray comes up, the command runs, Ray stops."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm.local_slurm import local_slurm, missing_requirements

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements())),
]


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    with local_slurm(tmp_path_factory.mktemp("slurm")) as env:
        yield os.environ | env


def _sbatch(env: dict[str, str], output: Path, *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sbatch", "--wait", f"--output={output}", "slurm/ray_job.sbatch", *command],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_ray_job_runs_the_command_on_a_ray_cluster_of_the_allocation(slurm_env: dict[str, str], tmp_path: Path) -> None:
    probe = "import ray; ray.init(); print('cpus', int(ray.cluster_resources()['CPU']), 'nodes', len(ray.nodes()))"
    result = _sbatch(slurm_env, tmp_path / "job.out", str(ROOT / ".venv/bin/python"), "-c", probe)
    log = (tmp_path / "job.out").read_text()
    assert result.returncode == 0, result.stderr + log
    assert f"cpus {os.cpu_count()} nodes 1" in log
    assert "[ray_cluster] all 1 node(s) joined" in log
    ray_left = subprocess.run(["pgrep", "-f", "ray_.*gcs_server"], capture_output=True, text=True, check=False)
    assert ray_left.stdout == "", "Ray processes outlived the job"


def test_ray_job_returns_the_command_exit_status(slurm_env: dict[str, str], tmp_path: Path) -> None:
    result = _sbatch(slurm_env, tmp_path / "job.out", "bash", "-c", "exit 3")
    assert result.returncode == 3, result.stderr


def test_train_sbatch_runs_the_rl_job_on_the_allocation(slurm_env: dict[str, str], tmp_path: Path) -> None:
    overrides = [
        "train.steps=1",
        "train.prompts_per_step=4",
        "validation.interval=0",
        f"checkpoint.dir={tmp_path / 'checkpoints'}",
        f"logging.dir={tmp_path / 'logs'}",
    ]
    result = subprocess.run(
        ["sbatch", "--wait", f"--output={tmp_path / 'job.out'}", "slurm/train.sbatch", "recipes/tiny_moe_cpu_dapo.yaml"]
        + overrides,
        cwd=ROOT,
        env=slurm_env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    log = (tmp_path / "job.out").read_text()
    assert result.returncode == 0, result.stderr + log
    assert "[ray_cluster] all 1 node(s) joined" in log
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000001"
    assert '"step": 1' in (tmp_path / "logs" / "metrics.jsonl").read_text()


def _preflight_sbatch(env: dict[str, str], tmp_path: Path, *overrides: str) -> tuple[int, str]:
    result = subprocess.run(
        ["sbatch", "--wait", f"--output={tmp_path / 'job.out'}", str(ROOT / "slurm" / "preflight.sbatch")]
        + [str(ROOT / "recipes" / "tiny_moe_cpu_dapo.yaml"), *overrides],
        cwd=tmp_path,
        env=env | {"MEGATRON_RL_ROOT": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    return result.returncode, result.stderr + (tmp_path / "job.out").read_text()


@pytest.mark.full  # exit statuses: test_ray_job_returns_the_command_exit_status
def test_preflight_sbatch_returns_preflight_exit_status_and_names_the_failed_step(
    slurm_env: dict[str, str], tmp_path: Path
) -> None:
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    status, log = _preflight_sbatch(slurm_env, tmp_path, f"checkpoint.dir={not_a_dir / 'checkpoints'}")
    assert status == 1, log
    assert "PASS install" in log and "FAIL storage" in log
    assert "not reached: devices, trainer, engines" in log
    assert (tmp_path / "runs" / "tiny-moe-cpu-dapo" / "preflight" / "report.json").is_file()


@pytest.mark.full  # CI: train.sbatch on Slurm, and the whole preflight on the SGLang recipe
def test_preflight_sbatch_passes_every_step_on_the_allocation(slurm_env: dict[str, str], tmp_path: Path) -> None:
    status, log = _preflight_sbatch(slurm_env, tmp_path)
    assert status == 0, log
    assert "[ray_cluster] all 1 node(s) joined" in log
    assert "# preflight passed" in log
