"""Running the tiny DAPO recipe as a user does (``megatron-rl train`` in a subprocess) and reading what it left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny_moe_cpu_dapo.yaml"
RUN = Path("runs") / "tiny-moe-cpu-dapo"
"""The run directory, relative to the working directory of the command."""


TWO_STEPS = [
    "train.steps=2",
    "train.prompts_per_step=4",
    "algorithm.dynamic_sampling.gen_batch_prompts=16",
    "validation.interval=2",
    "data.synthetic.num_val=16",
    "checkpoint.interval=0",
]
"""Overrides for a short run of the tiny recipe: 2 steps of 4 groups, validated before and after, no checkpoint."""
FOUR_STEPS = [
    "train.steps=4",
    "train.prompts_per_step=4",
    "algorithm.dynamic_sampling.gen_batch_prompts=16",
    "validation.interval=2",
    "checkpoint.interval=2",
    "data.synthetic.num_val=16",
    "logging.sinks=[jsonl]",
]
"""Overrides for the straight runs test_exact_resume and test_split_unchanged compare with: 4 steps of 4 groups,
validated at steps 0, 2 and 4, a checkpoint every 2 steps, metrics to metrics.jsonl only."""
PARTIAL_ROLLOUTS = [
    "rollout.partial_rollout_tokens=4",
    "rollout.partial_rollout_max_windows=3",
    "algorithm.preset=custom",
    "algorithm.dynamic_sampling.metric=score",
    "algorithm.dynamic_sampling.gen_batch_prompts=8",
]
"""Partial rollouts on the tiny recipe: 4-token windows over its 12-token responses, at most 3; dynamic sampling on
score variance, so steps fill and groups still generating are carried to the next step."""
TOOLS = [
    "rollout.episode=synthetic_tool_calls",
    "rollout.tools=[synthetic_lookup]",
    "rollout.max_turns=2",
    "rollout.tool_num_workers=1",
    "data.synthetic.task=lookup",
    "data.reward=synthetic_lookup",
]
"""Multi-turn episodes on the tiny recipe: the synthetic lookup task, whose tool the policy calls in up to 2 turns."""


def train_command(overrides: list[str], recipe: Path = RECIPE) -> list[str]:
    """``python -m megatron_rl.cli train <recipe (the tiny DAPO one)> <overrides>``."""
    return [sys.executable, "-m", "megatron_rl.cli", "train", str(recipe), *overrides]


def run_env(code: Path = ROOT) -> dict[str, str]:
    """This environment with ``code`` (a source tree of the project: this repository unless told) first on PYTHONPATH.

    PYTHONPATH comes before the editable install's finder, so ``megatron_rl`` is imported from ``code``.
    """
    return os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")]))}


def run_train(cwd: Path, overrides: list[str], recipe: Path = RECIPE, code: Path = ROOT) -> str:
    """Run the command in ``cwd`` to completion with ``code``'s megatron_rl; its stdout.

    Fails the test with stderr's tail on a non-zero exit.
    """
    result = subprocess.run(
        train_command(overrides, recipe),
        cwd=cwd,
        env=run_env(code),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


class StraightRuns:
    """Runs of this tree (``megatron-rl train`` to completion), each recipe and overrides run once per test session.

    Tests that compare against the same straight run read what that one run left (they must not change it).
    """

    def __init__(self, root: Path) -> None:
        self._root = root
        self._done: dict[tuple[Path, tuple[str, ...]], Path] = {}

    def run(self, recipe: Path, overrides: list[str]) -> Path:
        """The working directory of the finished run of ``recipe`` with ``overrides`` (its run directory inside);
        runs it on the first call."""
        key = (recipe, tuple(overrides))
        if key not in self._done:
            cwd = Path(tempfile.mkdtemp(prefix="straight-", dir=self._root))  # a failed run's leftovers stay apart
            run_train(cwd, overrides, recipe)
            self._done[key] = cwd
        return self._done[key]


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    """The records of ``<run_dir>/logs/metrics.jsonl``, in order."""
    return [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]


WALL_CLOCK_PREFIXES = ("time/", "perf/", "rollout/seconds", "actor/time_")
"""Metrics that measure time: they differ between two runs that compute the same things."""


def without_wall_clock(records: list[dict[str, float]]) -> list[dict[str, float]]:
    """``records`` without their wall-clock metrics: what two equal runs must agree on exactly."""
    return [{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK_PREFIXES)} for r in records]


def megatron_contents(checkpoint: Path, scratch: Path) -> dict[str, object]:
    """Everything in a checkpoint's ``megatron/`` directory, unsharded, by key: tensors and other state.

    Read with torch's DCP converter, so no process group is needed: the same keys at any layout.
    """
    target = scratch / f"{checkpoint.parent.parent.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint / "megatron", target)
    return torch.load(target, weights_only=False)


def full_tensors(checkpoint: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """The unsharded tensors of :func:`megatron_contents` (model weights and optimizer state)."""
    contents = megatron_contents(checkpoint, scratch)
    return {key: value for key, value in contents.items() if isinstance(value, torch.Tensor)}
