"""`megatron-rl preflight` of the tiny SGLang recipe on the real SGLang 0.5.23 (CPU): every step passes, the weight
sync is checked tensor by tensor with SGLang's own /weights_checker, and a sync that leaves a tensor out is named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.preflight.report import STEP_NAMES
from megatron_rl.weight_sync.fault_injection import SYNC_DROP_ENV
from tests.e2e.tiny_runs import ROOT, run_env

RECIPE = ROOT / "recipes" / "tiny_moe_cpu_dapo_sglang.yaml"
PREFLIGHT_MINUTES = 5
"""The issue's bound on a tiny recipe's whole preflight."""


def _preflight(cwd: Path, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], dict]:
    result = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "preflight", str(RECIPE)],
        cwd=cwd,
        env=run_env() | (env or {}),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    report = cwd / "runs" / "tiny-moe-cpu-dapo-sglang" / "preflight" / "report.json"
    return result, json.loads(report.read_text())


@pytest.mark.slow
def test_preflight_of_the_sglang_recipe_passes_every_step_and_plan_takes_its_rates(tmp_path: Path) -> None:
    result, report = _preflight(tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert report["passed"] and [step["name"] for step in report["steps"]] == list(STEP_NAMES)
    assert sum(step["seconds"] for step in report["steps"]) < PREFLIGHT_MINUTES * 60
    install, engines = report["steps"][0], report["steps"][-1]
    assert any("0.5.23" in line for line in install["lines"])
    assert "1 sglang engine(s)" in engines["lines"][0] and "bit for bit" in engines["lines"][1]
    # fp32 trainer against fp32 SGLang on the same weights: log-probs agree to rounding
    assert engines["figures"]["mismatch_abs_max"] < 1e-3
    markdown = (tmp_path / "runs" / "tiny-moe-cpu-dapo-sglang" / "preflight" / "report.md").read_text()
    for rate in ("gemm_tflops", "intra_node_gbps", "sync_gbps", "fs_write_gbps", "fs_read_gbps"):
        assert report["rates"][rate]["value"] > 0 and f"- {rate}: " in markdown

    report_path = tmp_path / "runs" / "tiny-moe-cpu-dapo-sglang" / "preflight" / "report.json"
    plan = [sys.executable, "-m", "megatron_rl.cli", "plan", str(ROOT / "recipes" / "qwen3_30b_a3b_dapo.yaml")]
    assumed = subprocess.run(plan, env=run_env(), capture_output=True, text=True, timeout=120, check=False)
    measured = subprocess.run(
        [*plan, "--rates", str(report_path)], env=run_env(), capture_output=True, text=True, timeout=120, check=False
    )
    assert measured.returncode == assumed.returncode and measured.stdout != assumed.stdout
    assert "measured by preflight" in measured.stdout
    for rate in report["rates"]:
        assert rate in measured.stdout


@pytest.mark.full
def test_a_sync_that_drops_a_tensor_is_named_by_sglangs_checksums(tmp_path: Path) -> None:
    result, report = _preflight(tmp_path, {SYNC_DROP_ENV: "model.layers.1.mlp.gate.weight"})
    assert result.returncode == 1
    failed = report["steps"][-1]
    assert failed["name"] == "engines" and not failed["passed"]
    assert failed["cause"].endswith(
        "1 tensor(s) differ after the sync from the trainer's weights it loaded: 0/model.layers.1.mlp.gate.weight"
    )
