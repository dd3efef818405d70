"""Fixtures shared by several test modules."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.hf_configs import QWEN3_30B_A3B_CONFIG_FILE


@pytest.fixture
def qwen3_30b_overrides(tmp_path: Path) -> list[str]:
    """Overrides making the 30B recipes independent of the working directory and of any download.

    ``model.path`` is an empty directory (nothing downloaded) and ``model.config_fallback`` the
    shipped Qwen3-30B-A3B config.json by absolute path; load with ``require_files=False``.
    """
    return [f"model.path={tmp_path / 'Qwen3-30B-A3B'}", f"model.config_fallback={QWEN3_30B_A3B_CONFIG_FILE}"]
