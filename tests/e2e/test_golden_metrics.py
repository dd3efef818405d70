"""The tiny DAPO recipe reproduces its golden metrics and final weights: refactors change no number.

Each case runs the tiny recipe for three steps from its seed (over-sampling with dynamic sampling,
validation before and after, a checkpoint at the end) and compares the per-step metrics, all but
wall-clock ones (:func:`~tests.e2e.tiny_runs.without_wall_clock`), and a SHA-256 of every tensor of
the final Megatron checkpoint (model and optimizer) with ``tests/snapshots/tiny_dapo_golden.json``.
The cases: ``sync``, the tiny DAPO recipe; ``async-partial``, its async variant with partial rollouts
(4-token windows, so groups are carried between steps).

The golden file was written by the code before the rollout manager was split into engine pool,
step selection and group assembler (issue 28), so it held that split to the same groups, seeds and
metrics; it holds any later refactor to them too. A deliberate change of the numbers (an algorithm
change, a new metric, another seed derivation) regenerates it, and the diff of the JSON shows what
changed: ``python -m tests.e2e.test_golden_metrics`` (from the repository root; about a minute per case
on 2 cores). The numbers are this machine's CPU float arithmetic (torch 2.14.1 on CPU): another CPU
or torch build may round differently, and then the file is regenerated on it first.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import TypedDict

import pytest
import torch

from tests.e2e.tiny_runs import RECIPE, ROOT, megatron_contents, read_metrics, run_train, without_wall_clock

GOLDEN = ROOT / "tests" / "snapshots" / "tiny_dapo_golden.json"
ASYNC_RECIPE = ROOT / "recipes" / "tiny_moe_cpu_dapo_async.yaml"
OVERRIDES = [
    "train.steps=3",
    "train.prompts_per_step=4",
    "algorithm.dynamic_sampling.gen_batch_prompts=16",
    "train.val_interval=3",
    "data.synthetic.num_val=16",
    "checkpoint.interval=3",
    "logging.sinks=[jsonl]",
]
PARTIAL = [
    "rollout.partial_rollout_tokens=4",
    "rollout.partial_rollout_max_windows=3",
    "algorithm.preset=custom",
    "algorithm.dynamic_sampling.metric=score",
    "algorithm.dynamic_sampling.gen_batch_prompts=8",
]


class Golden(TypedDict):
    """One case's record: per-step metrics without wall-clock ones, and the final checkpoint's tensor digests."""

    metrics: list[dict[str, float]]
    weights_sha256: dict[str, str]


CASES = {
    "sync": (RECIPE, Path("runs") / "tiny-moe-cpu-dapo", OVERRIDES),
    "async-partial": (ASYNC_RECIPE, Path("runs") / "tiny-moe-cpu-dapo-async", OVERRIDES + PARTIAL),
}


def run_case(case: str, workdir: Path) -> Golden:
    """Run ``case`` in ``workdir``: its metrics without wall-clock ones, and the final checkpoint's tensor digests."""
    recipe, run, overrides = CASES[case]
    run_train(workdir, overrides, recipe)
    contents = megatron_contents(workdir / run / "checkpoints" / "step_000003", workdir)
    digests = {
        key: hashlib.sha256(value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for key, value in sorted(contents.items())
        if isinstance(value, torch.Tensor)
    }
    return {"metrics": without_wall_clock(read_metrics(workdir / run)), "weights_sha256": digests}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_tiny_dapo_run_reproduces_its_golden_metrics_and_weights(tmp_path: Path, case: str) -> None:
    expected: Golden = json.loads(GOLDEN.read_text())[case]
    actual = run_case(case, tmp_path)
    assert [r["step"] for r in actual["metrics"]] == [r["step"] for r in expected["metrics"]]
    for want, got in zip(expected["metrics"], actual["metrics"], strict=True):
        assert got == want, f"step {want['step']}: " + ", ".join(
            f"{k}: {want.get(k)} -> {got.get(k)}" for k in sorted(want.keys() | got.keys()) if want.get(k) != got.get(k)
        )
    changed = [key for key, digest in expected["weights_sha256"].items() if actual["weights_sha256"].get(key) != digest]
    assert actual["weights_sha256"].keys() == expected["weights_sha256"].keys() and not changed, changed


def main() -> None:
    """Regenerate the golden file from this tree's code (every case, or those named on the command line)."""
    cases = sys.argv[1:] or list(CASES)
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    for case in cases:
        with tempfile.TemporaryDirectory() as workdir:
            golden[case] = run_case(case, Path(workdir))
    GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
