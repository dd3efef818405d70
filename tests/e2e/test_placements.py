"""The tiny DAPO recipe, colocated (one engine, memory handed over between phases) vs disaggregated (two engines).

Both runs train two steps with validation and a checkpoint at the end; they run at the same
time. Asserted: the colocated run records every hand-over phase of every step; the
disaggregated run records none; and both runs log the same metrics (all but wall-clock ones),
so releasing, offloading, reloading and resuming changes nothing the run learns. The
disaggregated engines' logs show the broadcast groups they joined hosted at 127.0.0.1: a
one-node run keeps its traffic on loopback (``tests/faults/test_two_nodes.py`` has engines
joining groups at another node's address).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.e2e.tiny_runs import RUN, TWO_STEPS, read_metrics, run_env, train_command, without_wall_clock

OVERRIDES = [*TWO_STEPS, "logging.sinks=[jsonl]"]
HAND_OVER_PHASES = {
    "time/engines_release_s",
    "time/actor_reload_s",
    "time/actor_offload_optimizer_s",
    "time/engines_resume_weights_s",
    "time/weight_sync_s",
    "time/actor_offload_params_s",
    "time/engines_resume_cache_s",
}


def _start(cwd: Path, *overrides: str) -> subprocess.Popen:
    cwd.mkdir()
    return subprocess.Popen(
        train_command([*OVERRIDES, *overrides]),
        cwd=cwd,
        env=run_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _records(cwd: Path) -> list[dict[str, float]]:
    return read_metrics(cwd / RUN)


def _weight_group_addresses(cwd: Path, engine: str) -> list[str]:
    log = (cwd / "runs" / "tiny-moe-cpu-dapo" / "logs" / f"{engine}.log").read_text()
    return re.findall(r"joining weight update group '\w+' at ([\d.]+):\d+", log)


@pytest.mark.slow
def test_colocated_hand_over_learns_exactly_as_disaggregated_engines(tmp_path: Path) -> None:
    colocated = _start(tmp_path / "colocated", "rollout.placement=colocated")
    disaggregated = _start(tmp_path / "disaggregated", "rollout.placement=disaggregated", "cluster.cpu_engines=2")
    for process in (colocated, disaggregated):
        _, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr[-4000:]

    colocated_records, disaggregated_records = _records(tmp_path / "colocated"), _records(tmp_path / "disaggregated")
    assert [r["step"] for r in colocated_records] == [0, 1, 2]
    for record in colocated_records[1:]:
        assert set(record) >= HAND_OVER_PHASES, f"step {record['step']} lacks {sorted(HAND_OVER_PHASES - set(record))}"
    for record in disaggregated_records[1:]:
        assert set(record) & HAND_OVER_PHASES == {"time/weight_sync_s"}
    assert without_wall_clock(colocated_records) == without_wall_clock(disaggregated_records)
    assert colocated_records[2]["actor/mismatch_abs_max"] < 1e-3  # engines generate with the synced weights
    assert all(r["train/update_skipped"] == 0.0 for r in colocated_records[1:])  # both steps trained
    for engine in ("reference0", "reference1"):
        addresses = _weight_group_addresses(tmp_path / "disaggregated", engine)
        assert addresses and set(addresses) == {"127.0.0.1"}, addresses
