"""A tiny run scoring through a reward server (``data.reward: remote``) whose process dies after the first step:
the later steps' responses score as failed and are counted, and the run completes.

The server is a real process (``tests/remote_reward_server.py``) scoring with ``synthetic_successor``; it exits
abruptly on the first request after the first step's, so which requests it answers is known exactly: the two
start-up probes (``prepare_data``'s reward check and the reward pool's) and the first step's responses.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.tiny_runs import ROOT, read_metrics, run_env, run_train

GRPO = ROOT / "recipes" / "tiny_moe_cpu_grpo.yaml"
RUN = Path("runs") / "tiny-moe-cpu-grpo"
PROMPTS, SAMPLES = 2, 16
"""Groups per step (no dynamic sampling in the GRPO preset, so every step scores exactly these) and their size."""
PROBES = 2


@pytest.mark.slow
def test_a_run_survives_its_reward_server_dying_after_the_first_step(tmp_path: Path) -> None:
    responses = PROMPTS * SAMPLES
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.remote_reward_server", "--die-after", str(PROBES + responses)],
        cwd=ROOT,
        env=run_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline().split()[1])
        out = run_train(
            tmp_path,
            [
                "data.reward=remote",
                f"data.remote_reward.url=http://127.0.0.1:{port}/score",
                "data.remote_reward.retries=1",
                "data.remote_reward.backoff_s=0.05",
                "train.steps=4",
                f"train.prompts_per_step={PROMPTS}",
                f"rollout.n_samples_per_prompt={SAMPLES}",
                "validation.interval=0",
                "checkpoint.interval=0",
                "logging.sinks=[jsonl]",
            ],
            recipe=GRPO,
        )
        assert server.wait(timeout=30) == 1  # it died (os._exit) on the second step's first request
    finally:
        server.kill()
        server.wait()
    assert "# done: 4 steps" in out
    steps = read_metrics(tmp_path / RUN)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r["rollout/reward_errors"] for r in steps] == [0.0] + [float(responses)] * 3
    assert all(r["rollout/reward_timeouts"] == 0.0 for r in steps)
    assert [r["train/accuracy"] for r in steps[1:]] == [0.0] * 3  # failed responses are judged wrong
    assert all(r["train/reward_mean"] == -1.0 for r in steps[1:])  # the empty response's score
