"""Metric sinks: JSONL records, resume truncation, TensorBoard scalars, W&B offline runs, console lines, the logger."""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_rl.config import LoggingConfig
from megatron_rl.metrics import (
    ConsoleSink,
    JsonlSink,
    TensorBoardSink,
    WandbSink,
    build_metric_logger,
    format_step_line,
)
from tests import wandb_transaction_log


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_writes_one_strict_json_object_per_step(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path)
    sink.log(1, {"train/reward_mean": 0.5, "train/length_correct_mean": math.nan})
    sink.log(2, {"train/reward_mean": 0.75})
    sink.close()
    assert _records(tmp_path / "metrics.jsonl") == [
        {"step": 1, "train/reward_mean": 0.5, "train/length_correct_mean": None},
        {"step": 2, "train/reward_mean": 0.75},
    ]


def test_jsonl_resume_drops_steps_after_the_checkpoint_and_a_torn_line(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path)
    for step in (1, 2, 3):
        sink.log(step, {"x": float(step)})
    sink.close()
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 4, "x"')
    resumed = JsonlSink(tmp_path, resume_step=2)
    resumed.log(3, {"x": 30.0})
    resumed.close()
    assert _records(tmp_path / "metrics.jsonl") == [
        {"step": 1, "x": 1.0},
        {"step": 2, "x": 2.0},
        {"step": 3, "x": 30.0},
    ]


def _scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    accumulator = EventAccumulator(str(log_dir / "tensorboard"))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def test_tensorboard_records_scalars_and_purges_after_resume(tmp_path: Path) -> None:
    sink = TensorBoardSink(tmp_path)
    for step in (1, 2, 3):
        sink.log(step, {"val/reward_mean": float(step)})
    sink.close()
    resumed = TensorBoardSink(tmp_path, resume_step=1)
    resumed.log(2, {"val/reward_mean": 20.0})
    resumed.close()
    assert _scalars(tmp_path, "val/reward_mean") == [(1, 1.0), (2, 20.0)]


def test_console_line_shows_present_headline_metrics_in_order() -> None:
    line = format_step_line(3, 60, {"actor/grad_norm": 0.12345, "train/reward_mean": -0.5, "train/accuracy": math.nan})
    assert line == "step 3/60 | reward -0.5 | acc n/a | grad_norm 0.1235"


def test_console_line_shows_each_validation_sets_mean_and_its_largest_ks_pass_and_maj() -> None:
    metrics = {
        "train/accuracy": 0.5,
        "val/greedy/mean@1": 0.875,
        "val/greedy/reward_mean": 0.75,
        "val/sampled/mean@8": 0.8125,
        **{f"val/sampled/{kind}@{k}": k / 10 for kind in ("pass", "maj") for k in (1, 4, 8)},
    }
    assert format_step_line(50, 150, metrics) == (
        "step 50/150 | acc 0.5 | val greedy mean@1 0.875 | val sampled mean@8 0.8125 pass@8 0.8 maj@8 0.8"
    )


def test_console_sink_prints_one_line_per_step() -> None:
    buffer = io.StringIO()
    sink = ConsoleSink(10, Console(file=buffer, width=200, color_system=None))
    sink.log(1, {"train/accuracy": 0.25})
    assert buffer.getvalue() == "step 1/10 | acc 0.25\n"


def test_logger_builds_the_configured_sinks_and_fans_out(tmp_path: Path) -> None:
    config = LoggingConfig(sinks=["jsonl", "tensorboard"])
    with build_metric_logger(config, log_dir=tmp_path, run_name="r", total_steps=2) as logger:
        logger.log(1, {"train/reward_mean": 1.0})
    assert _records(tmp_path / "metrics.jsonl") == [{"step": 1, "train/reward_mean": 1.0}]
    assert _scalars(tmp_path, "train/reward_mean") == [(1, 1.0)]


def test_wandb_sink_without_the_package_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ValueError, match=r"logging.sinks: 'wandb' needs the wandb package"):
        build_metric_logger(
            LoggingConfig(sinks=["wandb"], wandb_project="p"), log_dir=tmp_path, run_name="r", total_steps=1
        )


@pytest.fixture
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """W&B offline inside ``tmp_path``: no credentials, no home files, a server address that refuses connections."""
    for name in ("WANDB_API_KEY", "WANDB_ENTITY", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / "cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / "config"))
    monkeypatch.setenv("NETRC", str(home / "netrc"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-default"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(home / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(home / "wandb-data"))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB__DISABLE_STATS", "true")
    logs = tmp_path / "logs"
    logs.mkdir()
    return logs


def _wandb_logs(log_dir: Path) -> list[Path]:
    """The transaction logs of the offline runs under ``log_dir``, in the order the runs started."""
    logs = (log_dir / "wandb").glob("offline-run-*/run-*.wandb")
    return sorted(logs, key=lambda log: wandb_transaction_log.run_record(log).start_time.ToNanoseconds())


def _log_steps(sink: WandbSink, steps: dict[int, dict[str, float]]) -> None:
    for step, metrics in steps.items():
        sink.log(step, metrics)
    sink.close()


def test_wandb_offline_run_records_each_step_with_non_finite_values(offline_wandb: Path) -> None:
    steps: dict[int, dict[str, float]] = {
        1: {"train/reward_mean": 0.5, "train/length_correct_mean": math.nan},
        # a numpy scalar, as a metric computed with numpy is: the sink converts it (typed Mapping[str, float])
        2: {"train/reward_mean": np.float32(0.75), "actor/grad_norm": math.inf},  # type: ignore[dict-item]
        3: {"train/reward_mean": -math.inf},
    }
    _log_steps(WandbSink(offline_wandb, project="p", run_name="tiny"), steps)
    (log,) = _wandb_logs(offline_wandb)
    run = wandb_transaction_log.run_record(log)
    assert (run.project, run.display_name) == ("p", "tiny")
    assert run.run_id == (offline_wandb / WandbSink.RUN_ID_FILE).read_text().strip()
    np.testing.assert_equal(
        wandb_transaction_log.history(log), [(k, {n: float(v) for n, v in m.items()}) for k, m in steps.items()]
    )


def test_wandb_resume_rewinds_the_same_run_to_the_resume_step(offline_wandb: Path) -> None:
    _log_steps(WandbSink(offline_wandb, project="p", run_name="r"), {step: {"x": float(step)} for step in (1, 2, 3)})
    run_id = (offline_wandb / WandbSink.RUN_ID_FILE).read_text().strip()
    _log_steps(WandbSink(offline_wandb, project="p", run_name="r", resume_step=1), {2: {"x": 20.0}, 3: {"x": 30.0}})
    first, resumed = _wandb_logs(offline_wandb)
    assert wandb_transaction_log.history(first) == [(1, {"x": 1.0}), (2, {"x": 2.0}), (3, {"x": 3.0})]
    run = wandb_transaction_log.run_record(resumed)
    assert run.run_id == run_id
    assert (run.branch_point.run, run.branch_point.metric, run.branch_point.value) == (run_id, "_step", 1.0)
    assert wandb_transaction_log.history(resumed) == [(2, {"x": 20.0}), (3, {"x": 30.0})]


def test_wandb_fresh_run_in_the_same_directory_gets_a_new_id(offline_wandb: Path) -> None:
    _log_steps(WandbSink(offline_wandb, project="p", run_name="r"), {1: {"x": 1.0}})
    _log_steps(WandbSink(offline_wandb, project="p", run_name="r"), {1: {"x": 2.0}})
    first, second = (wandb_transaction_log.run_record(log) for log in _wandb_logs(offline_wandb))
    assert first.run_id != second.run_id
    assert (offline_wandb / WandbSink.RUN_ID_FILE).read_text().strip() == second.run_id


def test_wandb_resume_continues_the_run_where_the_rewind_is_refused(
    offline_wandb: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import wandb
    from wandb.errors import CommError

    _log_steps(WandbSink(offline_wandb, project="p", run_name="r"), {1: {"x": 1.0}})
    real_init = wandb.init

    def init_refusing_rewind(**kwargs: Any) -> wandb.Run:
        if "resume_from" in kwargs:
            raise CommError("failed to rewind run: run not found")
        return real_init(**kwargs)

    monkeypatch.setattr(wandb, "init", init_refusing_rewind)
    _log_steps(WandbSink(offline_wandb, project="p", run_name="r", resume_step=1), {2: {"x": 2.0}})
    first, resumed = _wandb_logs(offline_wandb)
    run = wandb_transaction_log.run_record(resumed)
    assert run.run_id == wandb_transaction_log.run_record(first).run_id
    assert run.resume and not run.HasField("branch_point")
    assert wandb_transaction_log.history(resumed) == [(2, {"x": 2.0})]


def test_wandb_sink_without_a_project_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"logging.wandb_project: required when logging.sinks includes 'wandb'"):
        build_metric_logger(LoggingConfig(sinks=["wandb"]), log_dir=tmp_path, run_name="r", total_steps=1)
