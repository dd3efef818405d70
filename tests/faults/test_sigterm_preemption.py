"""SIGTERM pre-empts a training driver as SIGUSR1 does, however Ray was started.

``ray.init`` sets SIGTERM to ``sys.exit`` and the driver's core worker puts abseil's failure handler
in front of it; the driver once aborted (exit 134, no checkpoint) on the SIGTERM that ``scancel``,
Slurm pre-emption and Kubernetes send. Two tests:

- the Ray start alone (local, and joining a head at ``RAY_ADDRESS``): a SIGTERM while ``ray.init``
  runs and one after it both reach the pre-emption request, abseil prints nothing, the process lives;
- the tiny DAPO run (no periodic checkpoint) gets SIGTERM once step 2 is logged, then SIGTERM and
  SIGUSR1 again (changing nothing): it saves the step it ends, exits 0 and leaves no process behind;
  started again, it ends with the metrics and the bit-identical Megatron checkpoint (model and Adam
  state) of the run trained without interruption.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.e2e.tiny_runs import (
    RECIPE,
    RUN,
    megatron_contents,
    read_metrics,
    run_env,
    run_train,
    train_command,
    without_wall_clock,
)
from tests.ray_processes import RAY, free_ports, kill_tree, node_ports, wait_for_nodes

STEPS = 6
OVERRIDES = [
    f"train.steps={STEPS}",
    "train.prompts_per_step=4",
    "rollout.n_samples_per_prompt=8",
    "algorithm.dynamic_sampling.gen_batch_prompts=16",
    "validation.interval=0",
    "checkpoint.interval=0",
    "logging.sinks=[jsonl]",
]
ABSEIL_REPORT = "SIGTERM received at time="
"""What abseil's failure handler (installed by Ray's core worker) prints when a signal reaches it."""

_START_RAY_SIGNALLED = """
import os, signal
import ray
import ray._private.worker as ray_worker
from megatron_rl.config import load_recipe
from megatron_rl.orchestration.preemption import preemption_requests
from megatron_rl.orchestration.resources import start_ray

connect = ray_worker.connect
def signalled_connect(*args, **kwargs):  # ray.init calls it after setting its SIGTERM handler, before the core worker
    os.kill(os.getpid(), signal.SIGTERM)
    return connect(*args, **kwargs)
ray_worker.connect = signalled_connect

cfg, _ = load_recipe(os.environ["RECIPE"], [], require_files=False)
with preemption_requests() as request:
    start_ray(cfg)
    print(f"during ray.init: {request.signal_name}", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    print("alive after a second SIGTERM", flush=True)
    ray.shutdown()
"""


@pytest.fixture
def ray_head() -> Iterator[dict[str, str]]:
    """A Ray head of its own on 127.0.0.1 (as ``slurm/ray_cluster.sh`` starts one); yields the environment joining it."""
    temp_dir = tempfile.mkdtemp(prefix="mrlterm-")  # short: Ray's socket paths live under it
    gcs_port, client_port = free_ports(2)
    env = run_env() | {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keeps 127.0.0.1, as ray_cluster.sh does on one node
    }
    head = subprocess.Popen(
        [RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs_port}", "--include-dashboard=false"]
        + [f"--ray-client-server-port={client_port}", *node_ports(), "--num-cpus=1", "--num-gpus=0"]
        + ["--temp-dir", temp_dir, "--disable-usage-stats", "--block"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        joining = env | {"RAY_ADDRESS": f"127.0.0.1:{gcs_port}"}
        wait_for_nodes(joining, 1)
        yield joining
    finally:
        kill_tree(head)


@pytest.mark.parametrize("ray_start", ["local", "RAY_ADDRESS"])
def test_sigterm_during_and_after_ray_init_reaches_the_preemption_request(
    request: pytest.FixtureRequest, ray_start: str
) -> None:
    local = {k: v for k, v in run_env().items() if k != "RAY_ADDRESS"}
    env = request.getfixturevalue("ray_head") if ray_start == "RAY_ADDRESS" else local
    done = subprocess.run(
        [sys.executable, "-c", _START_RAY_SIGNALLED],
        env=env | {"RECIPE": str(RECIPE)},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "during ray.init: SIGTERM\nalive after a second SIGTERM" in done.stdout, done.stdout
    assert ABSEIL_REPORT not in done.stderr, done.stderr[-3000:]


def _wait_for_step(process: subprocess.Popen, run_dir: Path, step: int) -> None:
    metrics = run_dir / "logs" / "metrics.jsonl"  # one line per step: no validation records
    deadline = time.monotonic() + 600
    while not metrics.exists() or metrics.read_text().count("\n") < step:
        assert process.poll() is None and time.monotonic() < deadline, f"the run ended or stalled before step {step}"
        time.sleep(0.1)


def _session_left(session: int) -> str:
    """The processes of session ``session`` (the driver's, with what it started) still there after 30 s ('' if none)."""
    deadline = time.monotonic() + 30  # Ray's processes, stopped by ray.shutdown, take a moment to go
    while (left := subprocess.run(["pgrep", "-a", "-s", str(session)], capture_output=True, text=True).stdout) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.5)
    return left


@pytest.mark.slow
def test_sigterm_to_the_driver_saves_its_step_exits_0_and_resumes_as_the_uninterrupted_run(tmp_path: Path) -> None:
    straight, signalled = tmp_path / "straight", tmp_path / "signalled"
    straight.mkdir()
    signalled.mkdir()
    run_train(straight, OVERRIDES)

    out, err = signalled / "driver.out", signalled / "driver.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        driver = subprocess.Popen(
            train_command(OVERRIDES),
            cwd=signalled,
            env=run_env(),
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,  # its own session: what is left of it afterwards can be found
        )
    try:
        _wait_for_step(driver, signalled / RUN, 2)
        driver.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        driver.send_signal(signal.SIGTERM)  # a second signal changes nothing
        driver.send_signal(signal.SIGUSR1)
        driver.wait(timeout=300)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    log, errors = out.read_text(), err.read_text()
    assert driver.returncode == 0, log[-2000:] + errors[-3000:]
    stopped = re.search(rf"# stopped for SIGTERM after step (\d+) of {STEPS}: the checkpoint of step \1 is saved", log)
    assert stopped, log[-3000:]
    step = int(stopped.group(1))
    assert 2 <= step < STEPS
    assert log.count("# SIGTERM received") == 1 and "SIGUSR1 received" not in log, log[-3000:]
    assert f"# stopped early: {step} of {STEPS} steps;" in log and "# done:" not in log, log[-3000:]
    assert ABSEIL_REPORT not in errors, errors[-3000:]
    checkpoints = signalled / RUN / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", f"step_{step:06d}"]
    assert (checkpoints / "latest").read_text().strip() == f"step_{step:06d}"
    assert _session_left(driver.pid) == ""

    assert f"# done: {STEPS} steps;" in run_train(signalled, OVERRIDES)
    expected, resumed = (
        without_wall_clock(read_metrics(straight / RUN)),
        without_wall_clock(read_metrics(signalled / RUN)),
    )
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert resumed == expected
    final = [
        megatron_contents(root / RUN / "checkpoints" / f"step_{STEPS:06d}", tmp_path) for root in (straight, signalled)
    ]
    assert final[0].keys() == final[1].keys()
    for key, value in final[0].items():
        other = final[1][key]
        if isinstance(value, torch.Tensor):
            assert isinstance(other, torch.Tensor) and torch.equal(other, value), key
        else:
            assert other == value, key
