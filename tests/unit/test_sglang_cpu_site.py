"""A CPU SGLang engine's processes pin no memory (``engines/native/cpu_site``): SGLang's LoRA code pins host
tensors, which torch cannot do without a GPU (the real engine with LoRA: ``tests/sglang/test_sglang_lora.py``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megatron_rl.engines.sglang_cpu import SITE_DIR, cpu_engine_environment

PINS = """
import sys
assert "torch" not in sys.modules, "the hook must not import torch itself"
import torch
x = torch.arange(6, dtype=torch.int32, pin_memory=True)
assert x.pin_memory() is x and x.tolist() == list(range(6))
assert torch.tensor([1.5], dtype=torch.float64, pin_memory=True, device="cpu").dtype == torch.float64
assert torch.zeros((2, 3), pin_memory=True).shape == (2, 3)
assert type(torch.__loader__).__name__ == type(torch.__spec__.loader).__name__ == "SourceFileLoader"
"""


def _run(code: str, pythonpath: str | None) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env |= {"PYTHONPATH": pythonpath} if pythonpath else {}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pins for real where torch sees a GPU")
def test_pinning_raises_without_a_gpu_and_is_a_no_op_on_the_engines_python_path():
    refused = _run("import torch; torch.zeros(1, pin_memory=True)", None)
    assert refused.returncode != 0 and "NVIDIA driver" in refused.stderr
    pinned = _run(PINS, str(SITE_DIR))
    assert pinned.returncode == 0, pinned.stderr


def test_the_engine_environment_leads_the_python_path_with_the_site_directory(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/inherited/a:/inherited/b")
    assert cpu_engine_environment()["PYTHONPATH"] == f"{SITE_DIR}:/inherited/a:/inherited/b"
