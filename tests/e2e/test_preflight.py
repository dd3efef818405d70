"""`megatron-rl preflight` end to end on CPU: every step passes on the default recipe, and one planted fault per step
fails that step with its cause and fix, listing the steps not reached (tests/sglang/test_preflight.py: the SGLang
recipe, and `plan --rates` on its report)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl.data.synthetic_tokenizer import save_synthetic_tokenizer
from megatron_rl.engines.reference.fault_injection import ENGINE_EXIT_ENV, engine_exit_fault
from megatron_rl.preflight.report import STEP_NAMES
from megatron_rl.weight_sync.fault_injection import SYNC_DROP_ENV
from tests.e2e.tiny_runs import RECIPE, ROOT, run_env
from tests.judge_model import judge_overrides, save_tiny_judge

GRPO = ROOT / "recipes" / "tiny_moe_cpu_grpo.yaml"

PREFLIGHT_MINUTES = 5
"""The issue's bound on a tiny recipe's whole preflight."""


def run_preflight(
    cwd: Path, overrides: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``megatron-rl preflight`` of the default recipe in ``cwd`` (its runs/ folder there)."""
    command = [sys.executable, "-m", "megatron_rl.cli", "preflight", str(RECIPE), *overrides]
    return subprocess.run(
        command, cwd=cwd, env=run_env() | (env or {}), capture_output=True, text=True, timeout=600, check=False
    )


def read_report(cwd: Path) -> dict:
    return json.loads((cwd / "runs" / "tiny-moe-cpu-dapo" / "preflight" / "report.json").read_text())


@pytest.mark.full  # CI runs the whole preflight on the SGLang recipe; the faults below pass its first steps here
def test_preflight_passes_every_step_on_the_default_recipe(tmp_path: Path) -> None:
    result = run_preflight(tmp_path, [])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = read_report(tmp_path)
    assert report["passed"] and not report["not_reached"]
    assert [step["name"] for step in report["steps"]] == list(STEP_NAMES)
    for name in STEP_NAMES:
        assert f"PASS {name}" in result.stdout
    assert sum(step["seconds"] for step in report["steps"]) < PREFLIGHT_MINUTES * 60
    assert set(report["rates"]) == {"gemm_tflops", "intra_node_gbps", "sync_gbps", "fs_write_gbps", "fs_read_gbps"}
    engines = next(step for step in report["steps"] if step["name"] == "engines")
    assert "bit for bit" in " ".join(engines["lines"])
    assert engines["figures"]["mismatch_abs_max"] < 1e-3  # fp32 trainer vs fp32 reference engine, same weights
    assert (tmp_path / "runs" / "tiny-moe-cpu-dapo" / "preflight" / "report.md").is_file()
    assert not (tmp_path / "runs" / "tiny-moe-cpu-dapo" / "checkpoints" / "latest").exists()


def _parquet_without_answers(path: Path) -> Path:
    pq.write_table(pa.table({"prompt": ["1 + 1 ="] * 8}), path)
    return path


def _fault_cases(tmp_path: Path) -> dict[str, tuple[list[str], dict[str, str], str, str]]:
    """Per step: overrides, environment, a word the cause must hold, and the recipe field or file the fix names."""
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    parquet = _parquet_without_answers(tmp_path / "no-answers.parquet")
    tokenizer = save_synthetic_tokenizer(tmp_path / "tokenizer")
    data = [
        f"data.train_files=[{parquet}]",
        "data.synthetic=null",
        "validation.interval=0",
        f"model.tokenizer={tokenizer}",
    ]
    return {
        "inputs": (data, {}, "reward_model", "data.answer_key"),
        "storage": ([f"checkpoint.dir={not_a_dir / 'checkpoints'}"], {}, str(not_a_dir), "checkpoint.dir"),
        "devices": (
            ["cluster.nodes=2", "cluster.network_interface=nope0", "cluster.cpu_engines=2", "parallel.ep=1"],
            {},
            "nope0",
            "cluster.network_interface",
        ),
        "engines-start": (
            [],
            {ENGINE_EXIT_ENV: engine_exit_fault(0, 10, tmp_path / "crashes")},
            "did not start",
            "rollout.",
        ),
        "engines-sync": ([], {SYNC_DROP_ENV: "model.layers.1.mlp.gate.weight"}, "mlp.gate", "weight_sync.transport"),
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault",
    [
        "inputs",
        "storage",
        "devices",
        # an engine exiting before it is healthy is also CI's tests/distributed/test_engine_failures.py
        pytest.param("engines-start", marks=pytest.mark.full),
        "engines-sync",
    ],
)
def test_a_planted_fault_fails_its_step_naming_cause_and_fix(tmp_path: Path, fault: str) -> None:
    overrides, env, cause, fix = _fault_cases(tmp_path)[fault]
    result = run_preflight(tmp_path, overrides, env)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    report = read_report(tmp_path)
    step = fault.split("-")[0]
    failed = report["steps"][-1]
    assert failed["name"] == step and not failed["passed"]
    assert all(s["passed"] for s in report["steps"][:-1])
    assert cause in failed["cause"], failed
    assert fix in failed["fix"], failed
    assert report["not_reached"] == list(STEP_NAMES[STEP_NAMES.index(step) + 1 :])
    assert f"FAIL {step}" in result.stdout and f"fix: {failed['fix']}" in result.stdout
    markdown = (tmp_path / "runs" / "tiny-moe-cpu-dapo" / "preflight" / "report.md").read_text()
    assert "**cause**" in markdown and all(f"| {name} | not reached |" in markdown for name in report["not_reached"])


@pytest.mark.full  # CI's judge run (tests/faults/test_judge_reward_run.py) starts the judge as preflight does
def test_preflight_of_a_judge_scored_recipe_starts_the_judge_and_scores_the_step_with_it(tmp_path: Path) -> None:
    model = save_tiny_judge(tmp_path / "judge")
    command = [sys.executable, "-m", "megatron_rl.cli", "preflight", str(GRPO), *judge_overrides(model)]
    result = subprocess.run(command, cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "runs" / "tiny-moe-cpu-grpo" / "preflight" / "report.json").read_text())
    assert report["passed"] and not report["not_reached"]
    engines = " ".join(next(step for step in report["steps"] if step["name"] == "engines")["lines"])
    assert f"judge: 1 engine(s) of {model} scored" in engines, engines
