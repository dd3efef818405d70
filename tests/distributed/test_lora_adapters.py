"""LoRA adapters on one Megatron rank (CPU, fp32): PEFT's init, the frozen base, the switch-off, and the
PEFT round trip (export, load into ``peft``, save with ``peft``, import back) bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from megatron_rl.config.hf_config import load_hf_config, parse_hf_config
from megatron_rl.config.schema import LoRAConfig
from megatron_rl.models.builder import build_model_chunks
from megatron_rl.models.forward import forward_logits
from megatron_rl.models.lora import adapters_disabled, apply_lora, lora_modules
from megatron_rl.models.lora_peft import lora_state_to_peft, peft_adapter_config, peft_to_lora_state
from megatron_rl.models.megatron_config import build_transformer_config
from megatron_rl.models.weight_transfer import export_hf_weights, load_hf_weights
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from tests.distributed_utils import run_distributed
from tests.lora_adapters import random_peft_adapter
from tests.tiny_checkpoints import VOCAB, save_tiny_moe

LORA = LoRAConfig(rank=2, alpha=8.0)


def _adapter_rank(rank: int, world_size: int, hf_dir: Path, adapter: dict[str, torch.Tensor]) -> dict:
    initialize_parallel(ParallelSizes())
    arch = parse_hf_config(load_hf_config(hf_dir))
    chunks = build_model_chunks(arch, build_transformer_config(arch, ParallelSizes(), params_dtype=torch.float32))
    load_hf_weights(chunks, arch, hf_dir)
    input_ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = forward_logits(chunks, [input_ids])[0]
    apply_lora(chunks, arch, LORA, seed=3)
    with torch.no_grad():
        fresh = forward_logits(chunks, [input_ids])[0]
    fresh_state = lora_state_to_peft(chunks)
    peft_to_lora_state(chunks, adapter, arch.num_experts)
    trainable = {n for chunk in chunks for n, p in chunk.named_parameters() if p.requires_grad}
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    logits = chunks[0](input_ids, positions, None)
    logits.float().pow(2).mean().backward()
    with torch.no_grad(), adapters_disabled(chunks):
        disabled = forward_logits(chunks, [input_ids])[0]
    grads = {n: p.grad for chunk in chunks for n, p in chunk.named_parameters() if p.grad is not None}
    result = {
        "base": base,
        "fresh": fresh,
        "fresh_state": fresh_state,
        "adapted": logits.detach(),
        "disabled": disabled,
        "trainable": trainable,
        "nonzero_grads": {n for n, g in grads.items() if g.abs().sum() > 0},
        "modules": len(list(lora_modules(chunks))),
    }
    destroy_parallel()
    return result


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return save_tiny_moe(tmp_path_factory.mktemp("lora") / "moe", all_sparse=True)


@pytest.mark.distributed
def test_adapters_train_alone_switch_off_and_start_as_the_base(hf_dir):
    arch = parse_hf_config(load_hf_config(hf_dir))
    (result,) = run_distributed(_adapter_rank, 1, hf_dir, random_peft_adapter(arch, LORA, seed=5))
    assert torch.equal(result["fresh"], result["base"]), "B starts at zero: the adapter starts as the base"
    assert torch.equal(result["disabled"], result["base"])
    assert (result["adapted"] - result["base"]).abs().max() > 0.1
    assert result["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in result["trainable"])
    assert result["nonzero_grads"] and result["nonzero_grads"] <= result["trainable"]
    fresh = result["fresh_state"]
    a_names = [n for n in fresh if n.endswith("lora_A.weight")]
    assert all(fresh[n].abs().max() > 0 for n in a_names)
    assert all(not fresh[n].any() for n in fresh if n.endswith("lora_B.weight"))
    fan_in = arch.hidden_size
    q_a = fresh["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    assert q_a.abs().max() <= fan_in**-0.5, "kaiming-uniform(a=sqrt(5)) is U(-1/sqrt(in), 1/sqrt(in))"


def _export_rank(rank: int, world_size: int, hf_dir: Path, adapter: dict[str, torch.Tensor], back: Path) -> dict:
    initialize_parallel(ParallelSizes())
    arch = parse_hf_config(load_hf_config(hf_dir))
    chunks = build_model_chunks(arch, build_transformer_config(arch, ParallelSizes(), params_dtype=torch.float32))
    apply_lora(chunks, arch, LORA)
    load_hf_weights(chunks, arch, hf_dir)
    peft_to_lora_state(chunks, adapter, arch.num_experts)
    exported = lora_state_to_peft(chunks)
    peft_to_lora_state(chunks, load_file(back), arch.num_experts)
    result = {
        "exported": exported,
        "reimported": lora_state_to_peft(chunks),
        "base": dict(export_hf_weights(chunks, arch)),
    }
    destroy_parallel()
    return result


@pytest.mark.distributed
def test_export_load_into_peft_save_and_import_back_is_bit_identical(hf_dir, tmp_path):
    """Also: the base weights load and export through the LoRA wrappers unchanged."""
    arch = parse_hf_config(load_hf_config(hf_dir))
    adapter = random_peft_adapter(arch, LORA, seed=7)
    exported_dir, resaved_dir = tmp_path / "exported", tmp_path / "resaved"
    exported_dir.mkdir()
    save_file(adapter, exported_dir / "adapter_model.safetensors")
    (exported_dir / "adapter_config.json").write_text(json.dumps(peft_adapter_config(LORA, str(hf_dir))))
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    PeftModel.from_pretrained(base, exported_dir).save_pretrained(resaved_dir)
    resaved = resaved_dir / "adapter_model.safetensors"
    assert any(".experts.base_layer." in n for n in load_file(resaved)), "peft saves the experts fused"
    (result,) = run_distributed(_export_rank, 1, hf_dir, adapter, resaved)
    for state in (result["exported"], result["reimported"]):
        assert set(state) == set(adapter)
        assert all(torch.equal(state[n], adapter[n]) for n in adapter)
    checkpoint = load_file(hf_dir / "model.safetensors")
    assert set(result["base"]) == set(checkpoint), "the base weights export as before, adapters left out"
    assert all(torch.equal(result["base"][n], checkpoint[n]) for n in checkpoint)
