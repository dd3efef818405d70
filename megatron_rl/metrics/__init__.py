"""Per-step metrics: console lines, JSONL, TensorBoard and optional Weights & Biases."""

from megatron_rl.metrics.console import HEADLINE_METRICS, ConsoleSink, format_step_line
from megatron_rl.metrics.logger import MetricLogger, build_metric_logger
from megatron_rl.metrics.sinks import JsonlSink, Metrics, MetricSink, TensorBoardSink, WandbSink

__all__ = [
    "HEADLINE_METRICS",
    "ConsoleSink",
    "JsonlSink",
    "MetricLogger",
    "MetricSink",
    "Metrics",
    "TensorBoardSink",
    "WandbSink",
    "build_metric_logger",
    "format_step_line",
]
