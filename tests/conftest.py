"""Fixtures shared by several test modules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.hf_configs import QWEN3_30B_A3B


@pytest.fixture
def qwen3_30b_overrides(tmp_path: Path) -> list[str]:
    """Overrides pointing the 30B recipes at a config-only Qwen3-30B-A3B checkpoint and empty data files."""
    ckpt = tmp_path / "Qwen3-30B-A3B"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    train, val = tmp_path / "train.parquet", tmp_path / "val.parquet"
    train.touch(), val.touch()
    return [f"model.path={ckpt}", f"data.train_files=[{train}]", f"data.val_files=[{val}]"]
