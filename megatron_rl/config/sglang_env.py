"""Which Python runs SGLang engine servers.

On GPU clusters SGLang is installed beside megatron-rl (``pip install -e '.[gpu]'``). For CPU runs
``./launch/setup.sh --sglang`` puts SGLang 0.5.23 in an environment of its own, ``.venv-sglang`` at
the repository root (``launch/requirements-sglang.lock`` says why it cannot share the trainer's).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from megatron_rl.config.sglang_pin import SGLANG_VERSION

SGLANG_PYTHON_ENV = "MEGATRON_RL_SGLANG_PYTHON"
"""Environment variable naming the Python executable to run ``sglang.launch_server`` with."""
SGLANG_VENV = Path(__file__).resolve().parents[2] / ".venv-sglang"
"""The environment ``./launch/setup.sh --sglang`` creates (a checkout's root; absent for a wheel install)."""
INSTALL_HINT = f"run ./launch/setup.sh --sglang, or set {SGLANG_PYTHON_ENV} to a Python with sglang {SGLANG_VERSION}"


def sglang_python() -> str | None:
    """The Python executable that runs SGLang servers, or None when none is found.

    In order: ``$MEGATRON_RL_SGLANG_PYTHON``; this interpreter when ``sglang`` is importable here;
    ``.venv-sglang/bin/python`` when that environment exists.
    """
    if os.environ.get(SGLANG_PYTHON_ENV):
        return os.environ[SGLANG_PYTHON_ENV]
    if importlib.util.find_spec("sglang") is not None:
        return sys.executable
    candidate = SGLANG_VENV / "bin" / "python"
    return str(candidate) if candidate.is_file() else None
