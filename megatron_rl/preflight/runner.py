"""Run preflight's steps in order, stop at the first failure, and write the report."""

from __future__ import annotations

import shutil
import time
import traceback
from collections.abc import Callable, Sequence

from megatron_rl.config import RunConfig
from megatron_rl.preflight.cluster import ClusterSteps
from megatron_rl.preflight.inputs import check_inputs, preflight_dir
from megatron_rl.preflight.install import check_install
from megatron_rl.preflight.report import STEP_NAMES, PreflightReport, StepFailure, StepOutcome, StepResult
from megatron_rl.preflight.storage import check_storage

UNEXPECTED_FIX = {
    "install": "./launch/setup.sh (--gpu on GPU nodes)",
    "inputs": "model.path, model.tokenizer, data.*",
    "devices": "cluster.* (nodes, gpus_per_node, network_interface) and the allocation",
    "trainer": "parallel.* and train.* (the traceback above names the part)",
    "engines": "rollout.* and weight_sync.* (the traceback above names the part)",
    "storage": "checkpoint.dir",
}
"""What to look at when a step fails with an error it did not anticipate (its traceback is printed)."""


def _run_step(name: str, step: Callable[[], StepOutcome]) -> tuple[StepResult, StepOutcome | None]:
    started = time.perf_counter()
    try:
        outcome = step()
    except StepFailure as failure:
        seconds = time.perf_counter() - started
        return StepResult(name, False, seconds, figures=failure.figures, cause=failure.cause, fix=failure.fix), None
    except Exception as error:  # a step's own bug or a library's error: reported as that step's failure
        traceback.print_exc()
        cause = f"{type(error).__name__}: {error}"
        return StepResult(name, False, time.perf_counter() - started, cause=cause, fix=UNEXPECTED_FIX[name]), None
    seconds = time.perf_counter() - started
    return StepResult(name, True, seconds, lines=outcome.lines, figures=outcome.figures), outcome


def run_preflight(
    cfg: RunConfig, recipe: str, overrides: Sequence[str], *, echo: Callable[[str], None] = print
) -> PreflightReport:
    """Every step of :data:`~megatron_rl.preflight.report.STEP_NAMES` on ``cfg`` in order, echoing each verdict line
    as it ends; at the first failure the rest are listed as not reached. The report is written under
    :func:`preflight_dir` (also when a step failed) and returned. Ray, trainer ranks and engines are released
    before return, whatever happened."""
    work_dir = preflight_dir(cfg)
    shutil.rmtree(work_dir, ignore_errors=True)  # preflight's own folder: a cut model or export of an earlier run
    report = PreflightReport(recipe, list(overrides))
    cluster = ClusterSteps(recipe, overrides, cfg, work_dir)
    steps: dict[str, Callable[[], StepOutcome]] = {
        "install": lambda: check_install(cfg),
        "inputs": lambda: check_inputs(cfg),
        "storage": lambda: check_storage(cfg),
        "devices": cluster.devices,
        "trainer": cluster.trainer,
        "engines": cluster.engines,
    }
    assert tuple(steps) == STEP_NAMES
    try:
        for index, (name, step) in enumerate(steps.items()):
            result, outcome = _run_step(name, step)
            report.steps.append(result)
            if outcome is not None:
                report.rates |= outcome.rates
            echo(report.step_line(result))
            for line in result.lines:
                echo(f"    {line}")
            if not result.passed:
                echo(f"    fix: {result.fix}")
                report.not_reached = list(STEP_NAMES[index + 1 :])
                break
    finally:
        cluster.close()
    report.write(work_dir)
    return report
