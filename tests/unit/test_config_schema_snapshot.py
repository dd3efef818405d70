"""Snapshot of the recipe schema's surface: a new or changed knob must be a deliberate change.

After changing the schema on purpose, regenerate with
``UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest tests/unit/test_config_schema_snapshot.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from megatron_rl.config import RunConfig

SNAPSHOT = Path(__file__).resolve().parents[1] / "snapshots" / "recipe_schema.json"


def test_recipe_schema_matches_snapshot() -> None:
    current = json.dumps(RunConfig.model_json_schema(), indent=1, sort_keys=True) + "\n"
    if os.environ.get("UPDATE_SNAPSHOTS") == "1":
        SNAPSHOT.write_text(current)
    assert current == SNAPSHOT.read_text(), "recipe schema changed: review the change, then regenerate (see module doc)"
