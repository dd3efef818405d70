"""One readable console line per step, with the headline metrics that are present."""

from __future__ import annotations

import math
import re

from rich.console import Console

from megatron_rl.metrics.sinks import Metrics

HEADLINE_METRICS: tuple[tuple[str, str], ...] = (
    ("train/reward_mean", "reward"),
    ("train/accuracy", "acc"),
    ("train/response_length_mean", "len"),
    ("actor/policy_loss", "pg_loss"),
    ("actor/approx_kl", "kl"),
    ("actor/entropy", "entropy"),
    ("actor/grad_norm", "grad_norm"),
    ("rollout/groups_dropped", "dropped"),
    ("perf/tokens_per_s", "tok/s"),
    ("time/step_s", "step_s"),
)
"""(metric name, short label) pairs shown on the console, in this order, when logged."""

_SET_METRIC = re.compile(r"val/(?P<set>[^/]+)/(?P<kind>mean|pass|maj)@(?P<k>\d+)")


def format_step_line(step: int, total_steps: int, metrics: Metrics) -> str:
    """``step 3/60 | reward 0.125 | acc 0.44 | ... | val greedy mean@1 0.9 | val sampled mean@8 0.8 pass@8 1
    maj@8 0.9``: the headline metrics present, then each validation set's mean@n and its largest k's pass@k and
    maj@k, 4 significant digits."""
    parts = [f"step {step}/{total_steps}"]
    for name, label in HEADLINE_METRICS:
        if name in metrics:
            parts.append(f"{label} {_number(metrics[name])}")
    sets: dict[str, dict[str, tuple[int, str]]] = {}
    for name in metrics:
        if (match := _SET_METRIC.fullmatch(name)) is not None:
            shown = sets.setdefault(match["set"], {})
            if int(match["k"]) >= shown.get(match["kind"], (0, ""))[0]:
                shown[match["kind"]] = (int(match["k"]), name)
    for set_name, shown in sets.items():
        values = [f"{name.rsplit('/', 1)[1]} {_number(metrics[name])}" for _, name in shown.values()]
        parts.append(f"val {set_name} " + " ".join(values))
    return " | ".join(parts)


def _number(value: float) -> str:
    value = float(value)
    return "n/a" if not math.isfinite(value) else f"{value:.4g}"


class ConsoleSink:
    """Prints :func:`format_step_line` for each step, flushed (colour only on a terminal)."""

    def __init__(self, total_steps: int, console: Console | None = None) -> None:
        self._total_steps = total_steps
        self._console = console or Console(highlight=False)

    def log(self, step: int, metrics: Metrics) -> None:
        self._console.print(format_step_line(step, self._total_steps, metrics), soft_wrap=True)
        self._console.file.flush()  # a line per step as it happens, also when piped to a file

    def close(self) -> None:
        """Nothing to release."""
