"""Fixtures shared by several test modules, and the two tiers: ``--full`` adds the tests marked ``full``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.hf_configs import QWEN3_30B_A3B_CONFIG_FILE


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        help="the full tier: also the tests marked full (learning curves, every recipe's smoke, the long variants)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without ``--full``, tests marked ``full`` are deselected (not skipped: CI's skip checks stay meaningful)."""
    if config.getoption("--full"):
        return
    kept = [item for item in items if item.get_closest_marker("full") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("full") is not None])
        items[:] = kept


@pytest.fixture
def qwen3_30b_overrides(tmp_path: Path) -> list[str]:
    """Overrides making the 30B recipes independent of the working directory and of any download.

    ``model.path`` is an empty directory (nothing downloaded) and ``model.config_fallback`` the
    shipped Qwen3-30B-A3B config.json by absolute path; load with ``require_files=False``.
    """
    return [f"model.path={tmp_path / 'Qwen3-30B-A3B'}", f"model.config_fallback={QWEN3_30B_A3B_CONFIG_FILE}"]
