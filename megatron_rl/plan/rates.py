"""Rates measured on a cluster by ``megatron-rl preflight``, as ``plan --rates REPORT.json`` reads them.

A report's ``rates`` map holds, per name of :data:`RATE_NAMES`, the value, its unit and ``source``: the
step and what it was measured on. The planner replaces the matching assumed rate by the measured one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

RATE_NAMES = {
    "gemm_tflops": "TFLOP/s of a dense GEMM in the trainer's dtype on the slowest trainer GPU (devices)",
    "intra_node_gbps": "all-gather bus bandwidth within a node, GB/s, the slowest group (devices)",
    "inter_node_gbps": "broadcast bandwidth across nodes, GB/s, from one sending rank (devices; several nodes only)",
    "sync_gbps": "bytes of the cut model synced into the engines per second, GB/s (engines)",
    "fs_write_gbps": "write rate of the checkpoint directory's file system, GB/s (storage)",
    "fs_read_gbps": "read rate of the checkpoint directory's file system, GB/s (storage)",
}
"""Every rate a report may hold, and what it measures."""


@dataclass(frozen=True)
class Rate:
    """A rate a preflight step measured: ``value`` (> 0) in ``unit``, and ``source``, what it was measured on."""

    value: float
    unit: str
    source: str


def parse_rates(rates: dict[str, dict[str, object]], where: str) -> dict[str, Rate]:
    """The ``rates`` map of a report; ValueError naming ``where`` and the rate when one is unknown or not > 0."""
    unknown = sorted(set(rates) - set(RATE_NAMES))
    if unknown:
        raise ValueError(f"{where}: unknown rates {unknown}; a preflight report holds some of {sorted(RATE_NAMES)}")
    parsed = {}
    for name, fields in rates.items():
        rate = Rate(float(fields["value"]), str(fields["unit"]), str(fields["source"]))  # type: ignore[arg-type]
        if not rate.value > 0:
            raise ValueError(f"{where}: rate {name} is {rate.value}, not a positive measurement")
        parsed[name] = rate
    return parsed


@dataclass(frozen=True)
class RatesReport:
    """What ``plan --rates`` takes from a report: its measured ``rates`` and its ``date`` (None when it has none)."""

    rates: dict[str, Rate]
    date: str | None


def read_report(path: Path) -> RatesReport:
    """The rates and date of a preflight ``report.json``; ValueError naming the file when it is not one."""
    try:
        data = json.loads(path.read_text())
        return RatesReport(parse_rates(data["rates"], str(path)), data.get("date"))
    except (OSError, KeyError, TypeError, AttributeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not a preflight report.json ({error!r}): run `megatron-rl preflight`") from error


def read_rates(path: Path) -> dict[str, Rate]:
    """The measured rates of a preflight ``report.json``; ValueError naming the file when it is not one."""
    return read_report(path).rates
