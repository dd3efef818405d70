"""The metric logger of a run: the sinks a recipe's ``logging`` section names, behind one call."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.config.schema import LoggingConfig
from megatron_rl.metrics.console import ConsoleSink
from megatron_rl.metrics.sinks import JsonlSink, Metrics, MetricSink, TensorBoardSink, WandbSink


class MetricLogger:
    """Fans each step's metrics out to every sink; a context manager that closes them all."""

    def __init__(self, sinks: Sequence[MetricSink]) -> None:
        self.sinks = list(sinks)

    def log(self, step: int, metrics: Metrics) -> None:
        """Record ``metrics`` of step ``step`` in every sink."""
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        """Close every sink (each is closed even if an earlier one raises)."""
        errors = []
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # close the rest, then re-raise the first
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> MetricLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclass(frozen=True)
class _SinkContext:
    logging: LoggingConfig
    log_dir: Path
    run_name: str
    total_steps: int
    resume_step: int


_SINK_FACTORIES: dict[str, Callable[[_SinkContext], MetricSink]] = {
    "console": lambda ctx: ConsoleSink(ctx.total_steps),
    "jsonl": lambda ctx: JsonlSink(ctx.log_dir, resume_step=ctx.resume_step),
    "tensorboard": lambda ctx: TensorBoardSink(ctx.log_dir, resume_step=ctx.resume_step),
    "wandb": lambda ctx: WandbSink(
        ctx.log_dir, project=ctx.logging.wandb_project, run_name=ctx.run_name, resume_step=ctx.resume_step
    ),
}


def build_metric_logger(
    logging: LoggingConfig, *, log_dir: str | Path, run_name: str, total_steps: int, resume_step: int = 0
) -> MetricLogger:
    """The sinks of ``logging.sinks``, writing under ``log_dir``; persisted records after ``resume_step`` are dropped."""
    ctx = _SinkContext(logging, Path(log_dir), run_name, total_steps, resume_step)
    return MetricLogger([_SINK_FACTORIES[name](ctx) for name in logging.sinks])
