"""README's figures for the suite are those of the last green ``.ci/run``, which records them in docs/ci-record.json.

``.ci/run`` rewrites the record after each green run on a clean clone (tests that ran, pytest's minutes, the whole
run's minutes with its installs); README quotes it in one sentence, and this test holds the two together, so a
figure cannot outlive the run it came from.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SENTENCE = re.compile(
    r"last green `\.ci/run` on a clean clone \((?P<date>\d{4}-\d\d-\d\d), `docs/ci-record\.json`\) ran "
    r"(?P<tests>[\d,]+) tests in (?P<pytest>[\d.]+) minutes of pytest and took (?P<ci>[\d.]+) minutes in all"
)


def test_readme_quotes_the_recorded_ci_run() -> None:
    record = json.loads((ROOT / "docs" / "ci-record.json").read_text())
    quoted = SENTENCE.search(" ".join((ROOT / "README.md").read_text().split()))
    assert quoted is not None, f"README has no sentence matching {SENTENCE.pattern!r}"
    assert quoted["date"] == record["date"]
    assert int(quoted["tests"].replace(",", "")) == record["tests_ran"]
    assert float(quoted["pytest"]) == record["pytest_minutes"]
    assert float(quoted["ci"]) == record["ci_minutes"]


def test_the_record_is_what_ci_writes() -> None:
    record = json.loads((ROOT / "docs" / "ci-record.json").read_text())
    assert set(record) == {"date", "tests_ran", "pytest_minutes", "ci_minutes"}
    assert record["tests_ran"] > 0 and 0 < record["pytest_minutes"] < record["ci_minutes"] <= 90
    assert '"docs/ci-record.json"' in (ROOT / ".ci" / "run").read_text()
