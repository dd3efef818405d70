"""Published Hugging Face configs used by tests (only their math fields; no weights)."""

import json
from pathlib import Path

QWEN3_30B_A3B_CONFIG_FILE = Path(__file__).resolve().parents[1] / "recipes/models/qwen3_30b_a3b/config.json"
QWEN3_30B_A3B = json.loads(QWEN3_30B_A3B_CONFIG_FILE.read_text())  # the shipped copy of Qwen/Qwen3-30B-A3B's

QWEN3_235B_A22B_CONFIG_FILE = Path(__file__).resolve().parents[1] / "recipes/models/qwen3_235b_a22b/config.json"
QWEN3_235B_A22B = json.loads(QWEN3_235B_A22B_CONFIG_FILE.read_text())  # the shipped copy of Qwen/Qwen3-235B-A22B's
