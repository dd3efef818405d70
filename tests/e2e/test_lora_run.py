"""LoRA runs end to end on the tiny recipe (``recipes/tiny_moe_cpu_dapo_lora.yaml``, the reference engine).

A disaggregated run syncs the adapter through PEFT files on disk and exports its checkpoint as the merged model plus
the adapter. Exact resume after SIGKILL is ``test_exact_resume.py``'s ``lora`` case.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.checkpoint.trainer_state import load_trainer_state
from megatron_rl.models.lora_merge import adapter_modules
from megatron_rl.models.safetensors_reader import SafetensorsCheckpoint
from tests.e2e.tiny_runs import ROOT, TWO_STEPS, read_metrics, run_train

LORA_RECIPE = ROOT / "recipes" / "tiny_moe_cpu_dapo_lora.yaml"
LORA_RUN = Path("runs") / "tiny-moe-cpu-dapo-lora"
pytestmark = pytest.mark.slow


@pytest.mark.full
def test_a_disaggregated_lora_run_syncs_through_disk_and_exports_the_merged_model(tmp_path: Path) -> None:
    overrides = [
        *[o for o in TWO_STEPS if not o.startswith("checkpoint.")],
        "rollout.placement=disaggregated",
        "weight_sync.transport=disk",
        "checkpoint.interval=2",
        "checkpoint.export_hf=true",
        "logging.sinks=[jsonl]",
    ]
    run_train(tmp_path, overrides, LORA_RECIPE)
    records = read_metrics(tmp_path / LORA_RUN)
    assert [r["step"] for r in records if "train/update_skipped" in r] == [1, 2]
    checkpoint = tmp_path / LORA_RUN / "checkpoints" / "step_000002"
    assert load_trainer_state(checkpoint).lora is not None
    adapter = load_file(checkpoint / "hf" / "adapter" / "adapter_model.safetensors")
    config = json.loads((checkpoint / "hf" / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (8, 32.0)
    assert any(name.endswith("lora_B.weight") and tensor.abs().max() > 0 for name, tensor in adapter.items())
    merged = SafetensorsCheckpoint(checkpoint / "hf")
    for module in adapter_modules(adapter):  # the export holds every adapted weight, merged (checked bitwise in
        assert torch.isfinite(merged.read(f"{module}.weight")).all()  # tests/distributed/test_lora_convert.py)
    left = sorted(p.name for p in (tmp_path / LORA_RUN / "weight_sync").iterdir())
    assert left == ["policy-v2"], "each adapter's directory goes once the engine unloaded it"
