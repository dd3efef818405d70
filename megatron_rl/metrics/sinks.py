"""Where per-step metrics go: console, JSONL, TensorBoard, Weights & Biases.

Every sink receives ``(step, metrics)`` with flat slash-separated names
(``val/reward_mean``, ``train/response_length_mean``) and float values; NaN marks a
statistic that is undefined this step (e.g. the mean length of correct responses when
none was correct). Sinks that persist (JSONL, TensorBoard) are resume-aware: opened with
``resume_step=k`` they drop what a killed run wrote after step ``k``, so a resumed run's
records are exactly those of an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, TextIO

Metrics = Mapping[str, float]


class MetricSink(Protocol):
    """A destination of per-step metrics."""

    def log(self, step: int, metrics: Metrics) -> None:
        """Record ``metrics`` of optimizer step ``step`` (1-based)."""

    def close(self) -> None:
        """Flush and release the sink."""


def _json_value(value: float) -> float | None:
    return value if math.isfinite(value) else None


class JsonlSink:
    """``<dir>/metrics.jsonl``: one JSON object per step, ``{"step": k, name: value, ...}``.

    Non-finite values are written as ``null`` (strict JSON). Lines are flushed as they are
    written, so a killed run loses at most the step being written.
    """

    FILE_NAME = "metrics.jsonl"

    def __init__(self, directory: str | Path, *, resume_step: int = 0) -> None:
        self.path = Path(directory) / self.FILE_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            _truncate_after(self.path, resume_step)
        self._file: TextIO = self.path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: Metrics) -> None:
        record = {"step": step} | {name: _json_value(float(value)) for name, value in metrics.items()}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _truncate_after(path: Path, resume_step: int) -> None:
    """Keep the records of steps <= ``resume_step`` (and drop a torn last line), atomically."""
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", 0) <= resume_step:
            kept.append(line)
    staging = path.with_suffix(".jsonl.tmp")
    staging.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
    os.replace(staging, path)


class TensorBoardSink:
    """TensorBoard scalars under ``<dir>/tensorboard``; a resumed run purges events after ``resume_step``."""

    def __init__(self, directory: str | Path, *, resume_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge_step = resume_step + 1 if resume_step > 0 else None
        self._writer = SummaryWriter(log_dir=str(Path(directory) / "tensorboard"), purge_step=purge_step)

    def log(self, step: int, metrics: Metrics) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, float(value), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Weights & Biases run ``project/run_name``, resumed under the same id after a restart."""

    def __init__(self, directory: str | Path, *, project: str | None, run_name: str, resume_step: int = 0) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ValueError("logging.sinks: 'wandb' needs the wandb package (pip install wandb)") from exc
        if project is None:
            raise ValueError("logging.wandb_project: required when logging.sinks includes 'wandb'")
        self._run = wandb.init(
            project=project, name=run_name, id=run_name, dir=str(directory), resume="allow" if resume_step > 0 else None
        )

    def log(self, step: int, metrics: Metrics) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()
