"""The layout move of issue 42 changed no number: the tiny DAPO runs go as on the commit the move was made from.

What it proves: moving the engine processes into ``engines/`` and the wire formats into ``wire/``, reshaping the
rank's training step into ``actor/train_step.py`` and typing the engine-host handles kept the groups, seeds, metrics
and weights of :data:`BASE` (main at 1d51acb, the commit before the move).

Each case runs a tiny recipe for four steps from its seed (over-sampling with dynamic sampling, validation at steps 0,
2 and 4, a checkpoint every 2 steps) twice on this machine with this interpreter and environment: once with
:data:`BASE`'s code and recipes (extracted from this repository's history with ``git archive`` and put first on
PYTHONPATH, ahead of the editable install), once with this tree's (the session's straight run of that configuration,
``straight_runs``, which test_exact_resume compares with too). The two runs' per-step metrics, all but wall-clock ones
(:func:`~tests.e2e.tiny_runs.without_wall_clock`), are exactly equal, and every tensor of the two final (step 4)
Megatron checkpoints (model and optimizer) is bit-equal, and so is the rest of their state (:func:`checkpoint_state`:
trainer state, LR scheduler, Megatron's RNG trackers, and in the async cases the unfinished groups carried to the next
step). Both sides use the same CPU's float arithmetic, so no number recorded on another machine is involved and any
x86 CPU or torch build gives the same verdict. The cases: ``sync``, the tiny DAPO recipe (dynamic sampling drops
groups and aborts the over-sampled rest); ``async-partial``, its async variant with partial rollouts (4-token windows,
so groups are carried between steps); ``async-partial-tools``, that with multi-turn tool episodes. Each checks that
its base run did exercise that.

Skipped, saying why, where the clone lacks :data:`BASE` (a shallow clone, or a tree outside git);
``.ci/run`` works in a plain ``git clone``, which has the full history. Once the move is merged this test has done
its job: retire it, or re-point :data:`BASE` at a later commit to hold another behaviour-preserving refactor to that
commit's numbers.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from tests.e2e.tiny_runs import (
    FOUR_STEPS,
    PARTIAL_ROLLOUTS,
    ROOT,
    TOOLS,
    StraightRuns,
    full_tensors,
    read_metrics,
    run_env,
    run_train,
    without_wall_clock,
)

BASE = "1d51acb7b1b8754a0b40ebc4a399bbbde2f5a406"
"""The commit the layout move of issue 42 was made from."""


CASES = {
    "sync": ("tiny_moe_cpu_dapo.yaml", Path("runs") / "tiny-moe-cpu-dapo", FOUR_STEPS),
    "async-partial": (
        "tiny_moe_cpu_dapo_async.yaml",
        Path("runs") / "tiny-moe-cpu-dapo-async",
        FOUR_STEPS + PARTIAL_ROLLOUTS,
    ),
    "async-partial-tools": (
        "tiny_moe_cpu_dapo_async.yaml",
        Path("runs") / "tiny-moe-cpu-dapo-async",
        FOUR_STEPS + PARTIAL_ROLLOUTS + TOOLS,
    ),
}
"""Each case: its recipe (in ``recipes/`` of the tree that runs it), its run directory, its overrides."""

EXERCISED = {
    "sync": ("rollout/groups_dropped", "rollout/groups_aborted"),
    "async-partial": ("rollout/groups_carried",),
    "async-partial-tools": ("rollout/groups_carried", "rollout/tool_calls"),
}
"""Counters each case's base run must have made non-zero at some step: the paths it is there to hold."""


@pytest.fixture(scope="module")
def base_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:data:`BASE`'s files, extracted from this repository with ``git archive``."""
    git = shutil.which("git")
    if git is None:
        pytest.skip(f"git is not installed: cannot extract the base commit {BASE[:7]} to compare with")
    found = subprocess.run(
        [git, "-C", str(ROOT), "cat-file", "-e", f"{BASE}^{{commit}}"], capture_output=True, check=False
    )
    if found.returncode != 0:
        pytest.skip(
            f"this checkout has no commit {BASE[:7]} (a shallow clone, or not a git clone): "
            "nothing to compare the layout move with; a full `git clone` has it"
        )
    archive = subprocess.run([git, "-C", str(ROOT), "archive", "--format=tar", BASE], capture_output=True, check=True)
    tree = tmp_path_factory.mktemp("base")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def imported_from(code: Path, cwd: Path) -> Path:
    """Where ``megatron_rl`` is imported from by a run with ``code`` on PYTHONPATH (the environment of ``run_train``)."""
    result = subprocess.run(
        [sys.executable, "-c", "import megatron_rl; print(megatron_rl.__file__)"],
        cwd=cwd,
        env=run_env(code),
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(result.stdout.strip()).resolve()


class CaseResult(NamedTuple):
    """What a case's run left: its metrics without wall-clock ones, its final checkpoint's tensors and other state."""

    metrics: list[dict[str, float]]
    tensors: dict[str, torch.Tensor]
    state: dict[str, object]


def checkpoint_state(checkpoint: Path) -> dict[str, object]:
    """A checkpoint's state besides its Megatron tensors, by file.

    ``trainer_state.json``, ``scheduler.pt``, ``carried_over.pt`` (None when the run carried nothing) and the
    Megatron RNG trackers of each rank's ``rng/`` file. Those files' Python, NumPy and torch global generator
    states are left out: the trainer never seeds them, so they differ between two runs of the same code.
    """
    carried = checkpoint / "carried_over.pt"
    return {
        "trainer_state.json": json.loads((checkpoint / "trainer_state.json").read_text()),
        "scheduler.pt": torch.load(checkpoint / "scheduler.pt", weights_only=False),
        "carried_over.pt": torch.load(carried, weights_only=False) if carried.exists() else None,
        **{
            f"rng/{path.name}[extra]": torch.load(path, weights_only=False)["extra"]
            for path in sorted((checkpoint / "rng").glob("*.pt"))
        },
    }


def case_result(case: str, workdir: Path, scratch: Path) -> CaseResult:
    """What ``case``'s finished run in ``workdir`` left (``scratch``: where its checkpoint is unsharded)."""
    run = CASES[case][1]
    checkpoint = workdir / run / "checkpoints" / "step_000004"
    metrics = without_wall_clock(read_metrics(workdir / run))
    return CaseResult(metrics, full_tensors(checkpoint, scratch), checkpoint_state(checkpoint))


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes, as a flat uint8 tensor."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


def same(a: object, b: object) -> bool:
    """``a == b`` all the way down: tensors bit-equal, a NaN equal to a NaN, dataclasses field by field."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and bit_equal(a, b)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        fields = [field.name for field in dataclasses.fields(a)]
        return type(a) is type(b) and all(same(getattr(a, name), getattr(b, name)) for name in fields)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("case", list(CASES))
def test_tiny_dapo_run_equals_the_base_commits_run(
    tmp_path: Path, base_tree: Path, straight_runs: StraightRuns, case: str
) -> None:
    recipe, _, overrides = CASES[case]
    for code in (base_tree, ROOT):
        assert imported_from(code, tmp_path).is_relative_to(code.resolve()), f"megatron_rl not imported from {code}"
    base_dir = tmp_path / "base"
    base_dir.mkdir()
    run_train(base_dir, overrides, base_tree / "recipes" / recipe, base_tree)
    base = case_result(case, base_dir, base_dir)
    this = case_result(case, straight_runs.run(ROOT / "recipes" / recipe, overrides), tmp_path)

    for counter in EXERCISED[case]:
        assert any(record.get(counter, 0) > 0 for record in base.metrics), f"the base run never had {counter} > 0"
    assert [r["step"] for r in this.metrics] == [r["step"] for r in base.metrics]
    for want, got in zip(base.metrics, this.metrics, strict=True):
        differing = sorted(k for k in want.keys() | got.keys() if not same(want.get(k), got.get(k)))
        assert not differing, f"step {want['step']}: " + ", ".join(
            f"{k}: {want.get(k)} -> {got.get(k)}" for k in differing
        )
    assert base.tensors, "the base checkpoint has no tensors"
    assert this.tensors.keys() == base.tensors.keys(), sorted(this.tensors.keys() ^ base.tensors.keys())
    changed = sorted(key for key in base.tensors if not bit_equal(base.tensors[key], this.tensors[key]))
    assert not changed, f"{len(changed)} of {len(base.tensors)} checkpoint tensors differ: {changed}"
    assert this.state.keys() == base.state.keys(), sorted(this.state.keys() ^ base.state.keys())
    changed = sorted(name for name in base.state if not same(base.state[name], this.state[name]))
    assert not changed, f"checkpoint state that differs: {changed}"
