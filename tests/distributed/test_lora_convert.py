"""``convert mcore-to-hf`` of a LoRA run checkpoint: the merged model and the PEFT adapter, exactly.

A run checkpoint is written as the trainer writes one (its ``trainer_state.json`` naming the ``lora:`` section,
the torch_dist model holding base and adapter) from the tiny Qwen3-MoE at TP2 with a random PEFT adapter on all
seven targets, loaded shard by shard. The CLI converts it at another layout (EP2). The adapter comes back bit for
bit (float32 both ways), and each merged weight is bitwise ``merge_lora_weights`` of the original base with the
original adapter: the float32 product is the same arithmetic on the same values.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.checkpoint.layout import HF_METADATA_DIR, MEGATRON_DIR
from megatron_rl.checkpoint.trainer_state import TrainerState, save_trainer_state
from megatron_rl.cli import main
from megatron_rl.config.hf_config import load_hf_config, parse_hf_config
from megatron_rl.config.schema import LoRAConfig
from megatron_rl.models.builder import build_qwen_model
from megatron_rl.models.hf_export import PEFT_ADAPTER_DIR
from megatron_rl.models.hf_files import copy_hf_metadata
from megatron_rl.models.lora import apply_lora
from megatron_rl.models.lora_merge import adapter_modules, merge_lora_weights
from megatron_rl.models.lora_peft import peft_to_lora_state
from megatron_rl.models.mcore_checkpoint import save_model_weights
from megatron_rl.models.safetensors_reader import SafetensorsCheckpoint
from megatron_rl.models.weight_transfer import load_hf_weights
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from tests.distributed_utils import run_distributed
from tests.lora_adapters import random_peft_adapter
from tests.tiny_checkpoints import save_tiny_moe

pytestmark = pytest.mark.distributed

LORA = LoRAConfig(rank=4, alpha=8.0)


def _write_lora_checkpoint(rank: int, world_size: int, hf_dir: Path, adapter_file: Path, out: Path) -> None:
    initialize_parallel(ParallelSizes(tp=2))
    try:
        arch, _, chunks = build_qwen_model(load_hf_config(hf_dir), ParallelSizes(tp=2), params_dtype=torch.float32)
        load_hf_weights(chunks, arch, hf_dir)
        apply_lora(chunks, arch, LORA)
        peft_to_lora_state(chunks, load_file(adapter_file), arch.num_experts)
        save_model_weights(chunks, out / MEGATRON_DIR)
    finally:
        destroy_parallel()


def test_a_lora_run_checkpoint_converts_to_the_merged_model_and_its_peft_adapter(tmp_path: Path) -> None:
    hf_dir = save_tiny_moe(tmp_path / "base")
    base = load_file(hf_dir / "model.safetensors")
    adapter = random_peft_adapter(parse_hf_config(load_hf_config(hf_dir)), LORA, seed=5)
    adapter_file = tmp_path / "adapter.safetensors"
    save_file(adapter, adapter_file)
    step = tmp_path / "run" / "step_000002"
    run_distributed(_write_lora_checkpoint, 2, hf_dir, adapter_file, step)
    copy_hf_metadata(hf_dir, step / HF_METADATA_DIR)
    save_trainer_state(step, TrainerState(step=2, sampler={}, weight_version=2, lora=LORA.model_dump(mode="json")))

    out = tmp_path / "hf"
    assert main(["convert", "mcore-to-hf", "--ckpt", str(step), "--out", str(out), "--ep", "2"]) == 0

    exported = load_file(out / PEFT_ADAPTER_DIR / "adapter_model.safetensors")
    assert exported.keys() == adapter.keys()
    assert all(exported[name].dtype == adapter[name].dtype and exported[name].equal(adapter[name]) for name in adapter)
    config = json.loads((out / PEFT_ADAPTER_DIR / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0, LORA.target_modules)

    merged, expected = SafetensorsCheckpoint(out), dict(merge_lora_weights(base.items(), adapter, 2.0))
    assert sorted(merged.names()) == sorted(expected)
    changed = {name for name in expected if not expected[name].equal(base[name])}
    assert changed == {f"{module}.weight" for module in adapter_modules(adapter)} and len(changed) == 16 + 36 + 3
    assert all(merged.read(name).equal(tensor) for name, tensor in expected.items())
