"""The CPU rehearsal of the GPU device check: ``scripts/device_check.sh --dry-run`` runs every check's code.

The same script, through the same shell entry point, with the same checks (parity,
a bf16 training step with fp32 master weights, offload/reload, the plan estimate,
an IPC weight sync into a reference engine, two colocated engines each fed by its own rank, the sync
measurement), on CPU: gloo instead of NCCL,
shared memory instead of CUDA IPC, no memory measurement. What stays untested
until a GPU runs it: the CUDA calls themselves.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


# Full tier (63 s): the rehearsal of what a lent GPU runs; run it before a device session.
@pytest.mark.full
@pytest.mark.distributed
def test_device_check_dry_run_passes_every_check(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "device_check.sh"), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = {r["name"]: r for r in json.loads((tmp_path / "gpu-checks.json").read_text())}
    assert set(results) == {
        "parity",
        "train",
        "offload",
        "plan",
        "ipc_sync",
        "colocated_contexts",
        "sync_bench",
        "sync_bench_more_tensors",
        "early_batches",
        "engine_invariance",
        "fp8_quantiser",
    }
    assert all(r["passed"] and r["error"] is None for r in results.values())
    assert results["fp8_quantiser"]["details"]["differing_shapes"] == []
    assert results["train"]["details"]["main_param_dtypes"] == ["torch.float32"]
    assert results["train"]["details"]["param_dtypes"] == ["torch.bfloat16"]
    assert results["offload"]["details"]["identical_after_reload"]
    assert results["ipc_sync"]["details"]["differing"] == [] and results["ipc_sync"]["details"]["tensors"] == 77
    assert results["ipc_sync"]["details"]["exported_dtypes"] == ["torch.bfloat16"]
    assert results["colocated_contexts"]["details"]["differing"] == [[], []]  # both engines, each by its own rank
    bench, more = results["sync_bench"]["details"], results["sync_bench_more_tensors"]["details"]
    for details in (bench, more):
        assert details["differing"] == [] and len(details["checked"]) == 6 and details["weight_version"] == "b4-2"
    assert bench["sync_1mb_buckets"] > 1 == bench["sync_4mb_buckets"]
    assert more["tensors"] - bench["tensors"] == 2 * 3 * 16  # 2 layers x 3 projections x 16 more experts
    assert "(same groups in all 2 steps)" in results["early_batches"]["details"]["report"]
    # pytest adds "(h:mm:ss)" past a minute (a loaded box)
    assert re.fullmatch(
        r"\d+ passed in [\d.]+s( \(\d+:\d\d:\d\d\))?", results["engine_invariance"]["details"]["report"]
    ), results["engine_invariance"]
    report = (tmp_path / "gpu-checks.md").read_text()
    assert "Mode: CPU dry run" in report and "| ipc_sync | PASS |" in report


def test_device_check_refuses_to_run_without_cuda_unless_dry(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "device_check.py"), "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "run with --dry-run" in done.stderr


def test_the_gpu_runs_recipe_and_plan_build_on_cpu(tmp_path):
    """The medium model's recipe (GPU mode) validates and the plan prices its state at 18 B per bf16 parameter."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("device_check", REPO / "scripts" / "device_check.py")
    assert spec is not None and spec.loader is not None
    device_check = importlib.util.module_from_spec(spec)
    sys.modules["device_check"] = device_check  # its dataclasses look their module up
    spec.loader.exec_module(device_check)
    cfg = device_check.run_config(False, tmp_path)
    assert cfg.cluster.gpus_per_node == 1 and cfg.train.precision == "bf16"
    assert cfg.model.random_init["hidden_size"] == 1024 and cfg.train.max_tokens_per_micro_batch == 4096
    estimate = device_check.plan_estimate(cfg)
    params = estimate["state_bytes"] / 18  # bf16 parameter 2 + fp32 gradient 4 + fp32 master, m, v 12
    assert 2.5e8 < params < 3.5e8 and params == int(params)
    assert 0 < estimate["working_bytes_without_reserve"] < estimate["state_bytes"]
