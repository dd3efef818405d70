"""Every script in benchmarks/ runs at its smallest size, in the command form the docs quote.

Each benchmark runs as a subprocess from the repository root and must exit 0 and print its table
and its last line, the ratio against the baseline it measured in the same run; no timing is
asserted. A script added to benchmarks/ without an entry in ``SMALLEST`` fails here, so no
benchmark rots unrun, and every command the docs quote for a benchmark must name a script and
flags that exist and the ``PYTHONPATH`` form the run here uses.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAIN_GUARD = 'if __name__ == "__main__":'
RATIO = r"[\d.]+x"

# A mention of a benchmark in the docs: the interpreter and PYTHONPATH before it when it is quoted as
# a command, and what follows up to the end of the quote, a comment or the line.
MENTION = re.compile(
    r"(?P<env>PYTHONPATH=\.\s+)?(?P<python>\.venv/bin/python\s+)?benchmarks/(?P<script>\w+\.py)(?P<rest>[^`#\n]*)"
)


@dataclass(frozen=True)
class Smallest:
    """A benchmark at its smallest size: the arguments after the script, and what it prints.

    ``column``: a column of its table (a header cell between bars or spaces). ``last_line``: a
    pattern the last line of its stdout matches (its ratio). ``pythonpath``: whether its command
    sets ``PYTHONPATH=.``, as the docs quote it (without it the script imports nothing from the
    repository but the package).
    """

    args: tuple[str, ...]
    column: str
    last_line: str
    pythonpath: bool = True


SMALLEST = {
    # Steps 2..N-1 are counted: 3 steps is the fewest with one.
    "async_overlap.py": Smallest(
        ("--steps", "3", "--repeats", "1"),
        "max_staleness",
        rf"^step time, synchronous / one-step off-policy: {RATIO}$",
        pythonpath=False,
    ),
    "balancing.py": Smallest(("--seeds", "1", "--limits", "64"), "method", r"ratio ours/naive = [\d.]+$"),
    "early_generation_batches.py": Smallest(
        ("--steps", "1"), "generation batches", rf"^dynamic sampling step, .*: {RATIO} \(same groups"
    ),
    # One step after one warm-up step: the overhead needs a measured step.
    "orchestration_overhead.py": Smallest(
        ("--steps", "2", "--warmup", "1"), "phase", r"^orchestration overhead of the tiny run: \d+% "
    ),
    "reference_engine_batching.py": Smallest(
        ("--repeats", "1"), "vs transformers 1 at a time", rf"in flight, .*: {RATIO} the tokens/s"
    ),
    # The 30B recipe, nothing downloaded, at 16 prompts; on one node its DP is 2, so Ray starts two
    # receivers instead of eight (each imports the package: a minute on two cores).
    # One run of each tree: the baseline commit comes from this clone's history (a plain `git clone` has it).
    "startup.py": Smallest(
        ("--repeats", "1"), "1-step run s (median)", rf"^1-step tiny run, this tree / baseline \w+: {RATIO} "
    ),
    "step_data_plane.py": Smallest(
        ("--samples", "128,256", "train.prompts_per_step=16", "cluster.nodes=1"),
        "rank/fair",
        r"^per-rank bytes / \(step bytes / dp\) = [\d.]+ ",
    ),
    "weight_sync_megatron.py": Smallest(
        ("--buckets-mb", "64", "--transports", "tensor", "--repeats", "1"),
        "/ plain copy",
        rf"^tensor transport / plain copy: {RATIO} ",
    ),
    "weight_sync_per_bucket.py": Smallest(
        ("--repeats", "1"), "ms per bucket (median)", rf"^tensor transport, ms per bucket: .* = {RATIO}$"
    ),
    "weight_sync_throughput.py": Smallest(
        ("--buckets-mb", "128", "--repeats", "1", "--engine-threads", "1"),
        "/ plain copy",
        rf"^tensor transport / plain copy, shared memory, 128 MiB buckets: {RATIO} ",
    ),
}


IN_CI = {"balancing.py", "early_generation_batches.py", "weight_sync_per_bucket.py"}
"""Benchmarks CI runs (under 20 s each on 2 cores); the others, 20-60 s each, run in the full tier."""


def runnable_benchmarks() -> list[str]:
    """The file names of benchmarks/ scripts: those with a main guard (helpers such as tables.py have none)."""
    return sorted(path.name for path in BENCHMARKS.glob("*.py") if MAIN_GUARD in path.read_text())


def benchmark_env(smallest: Smallest) -> dict[str, str]:
    """This environment with ``PYTHONPATH=.`` (the repository root, the working directory) or without any."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return (env | {"PYTHONPATH": "."}) if smallest.pythonpath else env


def doc_mentions() -> list[tuple[str, re.Match[str]]]:
    """Every mention of ``benchmarks/<script>.py`` in README.md and docs/, with the document's name."""
    return [(doc.name, match) for doc in DOCS for match in MENTION.finditer(doc.read_text())]


def test_every_benchmark_has_a_smallest_size() -> None:
    assert runnable_benchmarks() == sorted(SMALLEST), (
        "each script in benchmarks/ needs an entry in SMALLEST (and each entry a script), so CI runs it"
    )


def test_the_docs_quote_benchmarks_as_they_run_here() -> None:
    mentions = doc_mentions()
    assert any(match["python"] for _, match in mentions), "no quoted benchmark command found: is MENTION stale?"
    for doc, match in mentions:
        script = match["script"]
        assert script in SMALLEST, f"{doc} names benchmarks/{script}, which is not a runnable benchmark"
        if match["python"]:
            form = "PYTHONPATH=. .venv/bin/python" if SMALLEST[script].pythonpath else ".venv/bin/python"
            assert bool(match["env"]) == SMALLEST[script].pythonpath, f"{doc} quotes {match[0]!r}; it runs as {form}"
        # Flags read from the source: asking each script for --help would import torch once more per script.
        source = (BENCHMARKS / script).read_text()
        for flag in re.findall(r"--[a-z][\w-]*", match["rest"]):
            assert f'"{flag}"' in source, f"{doc} quotes {flag} for benchmarks/{script}, which has no such flag"


@pytest.mark.slow
@pytest.mark.parametrize(
    "script", [pytest.param(s, marks=() if s in IN_CI else pytest.mark.full) for s in runnable_benchmarks()]
)
def test_benchmark_runs_at_its_smallest_size(script: str) -> None:
    smallest = SMALLEST.get(script)
    assert smallest is not None, f"benchmarks/{script} has no smallest size in SMALLEST"
    result = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *smallest.args],
        cwd=ROOT,
        env=benchmark_env(smallest),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()
    header = re.compile(rf"(^|[|\s]){re.escape(smallest.column)}([|\s]|$)")
    assert any(header.search(line) for line in lines), f"no table column {smallest.column!r}:\n{result.stdout}"
    assert re.search(smallest.last_line, lines[-1]), f"last line {lines[-1]!r} !~ {smallest.last_line!r}"
