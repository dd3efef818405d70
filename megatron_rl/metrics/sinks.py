"""Where per-step metrics go: console, JSONL, TensorBoard, Weights & Biases.

Every sink receives ``(step, metrics)`` with flat slash-separated names
(``val/greedy/mean@1``, ``train/response_length_mean``) and float values; NaN marks a
statistic that is undefined this step (e.g. the mean length of correct responses when
none was correct). Sinks that persist (JSONL, TensorBoard, W&B) are resume-aware: opened
with ``resume_step=k`` they drop what a killed run wrote after step ``k``, so a resumed run's
records are exactly those of an uninterrupted one (W&B: where its server can rewind a run).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, TextIO

Metrics = Mapping[str, float]

logger = logging.getLogger(__name__)


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
    """Weights & Biases run named ``run_name`` in ``project``, files under ``<dir>/wandb``.

    A fresh run (``resume_step=0``) starts a W&B run with a new id, kept in
    ``<dir>/wandb_run_id`` (replacing an older one). A resumed run continues the kept id and
    rewinds its history to ``resume_step`` (W&B's ``resume_from``), so W&B ends, like the
    JSONL and TensorBoard sinks, with the records of an uninterrupted run; with no kept id it
    starts a new W&B run. Where the server refuses the rewind
    (a W&B preview feature), the run is continued instead (``resume="allow"``): W&B then
    keeps what the killed run logged after ``resume_step`` and ignores the resumed run's
    steps up to the last one it has. Online or offline follows ``WANDB_MODE``; non-finite
    values are logged as they are (W&B stores NaN and +-inf).
    """

    RUN_ID_FILE = "wandb_run_id"

    def __init__(self, directory: str | Path, *, project: str | None, run_name: str, resume_step: int = 0) -> None:
        if project is None:
            raise ValueError("logging.wandb_project: required when logging.sinks includes 'wandb'")
        try:
            import wandb
        except ImportError as exc:
            raise ValueError("logging.sinks: 'wandb' needs the wandb package (pip install wandb)") from exc
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        id_file = directory / self.RUN_ID_FILE
        init = functools.partial(wandb.init, project=project, name=run_name, dir=str(directory))
        previous_id = _read_run_id(id_file) if resume_step > 0 else None
        if previous_id is None:
            self._run = init(id=_new_run_id(id_file))
        else:
            self._run = _resume_run(init, previous_id, resume_step)

    def log(self, step: int, metrics: Metrics) -> None:
        self._run.log({name: float(value) for name, value in metrics.items()}, step=step)

    def close(self) -> None:
        """Finish the run and wait until W&B has written (and, online, sent) all of it.

        ``run.finish`` alone may return before W&B's service has flushed the run's
        transaction log; ``wandb.teardown`` stops that service once every run is done.
        """
        import wandb

        try:
            self._run.finish()
        finally:
            wandb.teardown()


def _read_run_id(path: Path) -> str | None:
    """The W&B run id stored in ``path``, or None when there is none."""
    try:
        return path.read_text(encoding="utf-8").strip() or None
    except FileNotFoundError:
        return None


def _new_run_id(path: Path) -> str:
    """A new random W&B run id, written to ``path`` (atomically) before it is returned."""
    from wandb.sdk.lib.runid import generate_id

    run_id = generate_id()
    staging = path.with_suffix(".tmp")
    staging.write_text(run_id + "\n", encoding="utf-8")
    os.replace(staging, path)
    return run_id


def _resume_run(init: Callable[..., Any], run_id: str, resume_step: int) -> Any:
    """Run ``run_id`` rewound to ``resume_step``; continued as it is where the server refuses the rewind."""
    from wandb.errors import Error

    try:
        return init(id=run_id, resume_from=f"{run_id}?_step={resume_step}")
    except Error as exc:
        logger.warning("W&B refused to rewind run %s to step %d (%s); continuing it as it is", run_id, resume_step, exc)
        return init(id=run_id, resume="allow")
