"""The preflight report: each step's verdict, seconds, measured figures and cause, and the rates ``plan`` reads.

Written as ``report.md`` and ``report.json`` under ``runs/<name>/preflight/``. The JSON form is what
``megatron-rl plan --rates`` reads: its ``rates`` map holds each rate a step measured (:data:`RATE_NAMES`),
with its unit and the step and what it was measured on.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.plan.rates import Rate, parse_rates

STEP_NAMES = ("install", "inputs", "storage", "devices", "trainer", "engines")
"""The steps in the order they run, those on this node first (seconds) before the allocation's (minutes); a failed
step stops the run, and the rest are listed as not reached."""


class StepFailure(Exception):
    """A step's check failed: ``cause`` says what was found, ``fix`` the recipe field or file to change."""

    def __init__(self, cause: str, fix: str, figures: dict[str, Any] | None = None) -> None:
        super().__init__(cause)
        self.cause, self.fix, self.figures = cause, fix, dict(figures or {})


@dataclass
class StepOutcome:
    """What a passing step found: ``lines`` (what was checked, for the report), ``figures`` (measured values)
    and ``rates`` (keys of :data:`RATE_NAMES`)."""

    lines: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    rates: dict[str, Rate] = field(default_factory=dict)


@dataclass
class StepResult:
    """One step's verdict: passed, seconds taken, its outcome, and on failure the cause and the fix."""

    name: str
    passed: bool
    seconds: float
    lines: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    cause: str | None = None
    fix: str | None = None


@dataclass
class PreflightReport:
    """The whole run: recipe, the steps run (in order), those not reached, and the measured rates."""

    recipe: str
    overrides: list[str]
    steps: list[StepResult] = field(default_factory=list)
    not_reached: list[str] = field(default_factory=list)
    rates: dict[str, Rate] = field(default_factory=dict)
    date: str = field(default_factory=lambda: datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))

    @property
    def passed(self) -> bool:
        """Every step ran and passed."""
        return not self.not_reached and all(step.passed for step in self.steps)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready data (``passed`` included)."""
        return {"passed": self.passed, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PreflightReport:
        """Inverse of :meth:`to_json`; raises ValueError naming an unknown rate (:data:`~megatron_rl.plan.rates.RATE_NAMES`)."""
        return cls(
            recipe=data["recipe"],
            overrides=list(data["overrides"]),
            steps=[StepResult(**step) for step in data["steps"]],
            not_reached=list(data["not_reached"]),
            rates=parse_rates(data["rates"], "the preflight report"),
            date=data["date"],
        )

    def step_line(self, step: StepResult) -> str:
        """``PASS name  12.3 s`` or ``FAIL name  12.3 s: cause``."""
        verdict = f"{'PASS' if step.passed else 'FAIL'} {step.name:<8} {step.seconds:7.1f} s"
        return verdict if step.passed else f"{verdict}: {step.cause}"

    def to_markdown(self) -> str:
        """The report for people: a table of steps, each step's lines and figures, the fix of a failure."""
        lines = [
            f"# Preflight of {self.recipe} {' '.join(self.overrides)}".rstrip(),
            "",
            f"{self.date}: {'PASSED' if self.passed else 'FAILED'}",
            "",
            "| step | verdict | seconds |",
            "| --- | --- | --- |",
        ]
        lines += [f"| {s.name} | {'pass' if s.passed else 'FAIL'} | {s.seconds:.1f} |" for s in self.steps]
        lines += [f"| {name} | not reached | |" for name in self.not_reached]
        for step in self.steps:
            lines += ["", f"## {step.name}", ""]
            lines += [f"- {line}" for line in step.lines]
            lines += [f"- {key}: {value}" for key, value in step.figures.items()]
            if not step.passed:
                lines += [f"- **cause**: {step.cause}", f"- **fix**: {step.fix}"]
        if self.rates:
            lines += ["", "## Measured rates (`megatron-rl plan RECIPE --rates report.json`)", ""]
            lines += [f"- {name}: {r.value:.4g} {r.unit} ({r.source})" for name, r in self.rates.items()]
        return "\n".join(lines) + "\n"

    def write(self, directory: Path) -> tuple[Path, Path]:
        """Write ``report.md`` and ``report.json`` into ``directory`` (created); returns both paths."""
        directory.mkdir(parents=True, exist_ok=True)
        markdown, data = directory / "report.md", directory / "report.json"
        markdown.write_text(self.to_markdown())
        data.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return markdown, data


def read_report(path: Path) -> PreflightReport:
    """A ``report.json`` written by :meth:`PreflightReport.write`; ValueError naming the file when it is not one."""
    try:
        return PreflightReport.from_json(json.loads(path.read_text()))
    except (KeyError, TypeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not a preflight report.json ({error!r}): run `megatron-rl preflight`") from error
