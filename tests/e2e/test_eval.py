"""``megatron-rl eval`` on a run's last checkpoint: the run's own validation, reproduced by engines alone.

A short run of the default recipe (2 steps, both of its validation sets at steps 0 and 2), then ``eval`` on its
checkpoint folder. Every metric of both sets equals the run's step-2 validation exactly: the engine serves the
checkpoint's weights (converted from torch_dist, as ``eval`` does without an ``hf/`` export), the weights the run
had synced, greedy decoding is deterministic, and the sampled set draws with the seeds of step 2, which the
checkpoint names (``ValidationSet.generate``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.tiny_runs import RECIPE, RUN, read_metrics, run_env, run_train

OVERRIDES = [
    "train.steps=2",
    "train.prompts_per_step=4",
    "algorithm.dynamic_sampling.gen_batch_prompts=16",
    "validation.interval=2",
    "checkpoint.interval=0",
    "data.synthetic.num_val=16",
    "logging.sinks=[jsonl]",
]
PROMPTS, SAMPLED_N = 16, 8


def _eval(cwd: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "megatron_rl.cli", "eval", str(RECIPE), *OVERRIDES, *extra]
    return subprocess.run(command, cwd=cwd, env=run_env(), capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.slow
def test_eval_of_the_last_checkpoint_reproduces_the_runs_last_validation(tmp_path: Path) -> None:
    run_train(tmp_path, OVERRIDES)
    last = read_metrics(tmp_path / RUN)[-1]
    assert last["step"] == 2

    result = _eval(tmp_path, "--checkpoint", str(RUN / "checkpoints"))
    assert result.returncode == 0, result.stderr[-4000:]
    out = tmp_path / RUN / "eval" / "checkpoints"
    greedy = json.loads((out / "greedy.json").read_text())
    sampled = json.loads((out / "sampled.json").read_text())
    for name, metrics in (("greedy", greedy), ("sampled", sampled)):
        logged = {
            key.removeprefix(f"val/{name}/"): value for key, value in last.items() if key.startswith(f"val/{name}/")
        }
        assert metrics == logged, name
    assert sampled["pass@1"] == sampled["mean@8"] and sampled["maj@8"] <= sampled["pass@8"]

    rows = [json.loads(line) for line in (out / "sampled.jsonl").read_text().splitlines()]
    assert len(rows) == PROMPTS * SAMPLED_N
    assert {(row["prompt_index"], row["sample"]) for row in rows} == {
        (prompt, sample) for prompt in range(PROMPTS) for sample in range(SAMPLED_N)
    }
    assert sum(row["correct"] for row in rows) / len(rows) == sampled["mean@8"]
    assert all(row["set"] == "sampled" and isinstance(row["response"], str) for row in rows)
    assert all((row["answer"] is None) == (row["response"].replace("<pad>", "").strip() == "") for row in rows)
    table = (out / "results.md").read_text()
    assert (
        table.splitlines()[0]
        == "| set | n | temperature | top_p | mean@1 | mean@8 | pass@1 | maj@1 | pass@4 | maj@4 | pass@8 | maj@8 |"
    )
    assert table in result.stdout
    assert json.loads((out / "results.json").read_text())["sets"]["sampled"]["metrics"] == sampled

    again = _eval(tmp_path, "--checkpoint", str(RUN / "checkpoints"), "--sets", "greedy")
    assert again.returncode == 0, again.stderr[-4000:]
    assert "greedy done before, read back" in again.stdout and "# eval: set" not in again.stdout


def test_eval_refuses_an_unknown_set_or_a_missing_checkpoint_before_starting_anything(tmp_path: Path) -> None:
    unknown = _eval(tmp_path, "--hf", str(tmp_path), "--sets", "aime")
    assert unknown.returncode == 1 and "--sets: ['aime'] not in the recipe's validation.sets" in unknown.stderr
    missing = _eval(tmp_path, "--checkpoint", str(tmp_path / "nowhere"))
    assert missing.returncode == 1 and "--checkpoint: no such directory" in missing.stderr
