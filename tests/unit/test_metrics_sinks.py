"""Metric sinks: JSONL records, resume truncation, TensorBoard scalars, console lines, the logger."""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path

import pytest
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_rl.config import LoggingConfig
from megatron_rl.metrics import ConsoleSink, JsonlSink, TensorBoardSink, build_metric_logger, format_step_line


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
    line = format_step_line(3, 60, {"actor/grad_norm": 0.12345, "train/reward_mean": -0.5, "val/accuracy": math.nan})
    assert line == "step 3/60 | reward -0.5 | val_acc n/a | grad_norm 0.1235"


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
