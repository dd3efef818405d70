"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import pytest

from tests.e2e.tiny_runs import StraightRuns


@pytest.fixture(scope="session")
def straight_runs(tmp_path_factory: pytest.TempPathFactory) -> StraightRuns:
    """This tree's straight runs, each configuration run once a session: test_exact_resume and
    test_split_unchanged compare with the same ones."""
    return StraightRuns(tmp_path_factory.mktemp("straight-runs"))
