"""``merge_lora_weights``: a merged checkpoint computes what ``peft``'s ``PeftModel`` computes with the adapter.

Both models run in float64 on the tiny dense Qwen3 and the tiny Qwen3-MoE (every layer sparse, expert adapters):
the merged weight ``W + s B A`` and PEFT's ``W x + s B (A x)`` differ only by float64 rounding. Each logit is a
chain of a few thousand float64 products and sums of O(1) terms, so their difference is a few thousand units of
2^-53 ~ 1.1e-16 times the largest intermediate: ATOL = 1e-9 is orders of magnitude above it, and orders below
the adapter's own effect (asserted > 0.1).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from megatron_rl.config.hf_config import load_hf_config, parse_hf_config
from megatron_rl.config.schema import LoRAConfig
from megatron_rl.models.lora_merge import adapter_modules, merge_lora_weights
from megatron_rl.models.lora_peft import peft_adapter_config
from tests.lora_adapters import random_peft_adapter
from tests.tiny_checkpoints import VOCAB, save_tiny_dense, save_tiny_moe

ATOL = 1e-9
LORA = LoRAConfig(rank=4, alpha=8.0)


def _model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager"
    ).eval()


def _logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids).logits


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_merged_checkpoint_computes_what_peft_computes_with_the_adapter(tmp_path: Path, kind: str) -> None:
    hf_dir = (
        save_tiny_dense(tmp_path / "base") if kind == "dense" else save_tiny_moe(tmp_path / "base", all_sparse=True)
    )
    adapter = random_peft_adapter(parse_hf_config(load_hf_config(hf_dir)), LORA, seed=3)
    adapter_dir = tmp_path / "adapter"
    adapter_dir.mkdir()
    save_file(adapter, adapter_dir / "adapter_model.safetensors")
    (adapter_dir / "adapter_config.json").write_text(json.dumps(peft_adapter_config(LORA, str(hf_dir))))

    base = {name: tensor.double() for name, tensor in load_file(hf_dir / "model.safetensors").items()}
    merged = dict(merge_lora_weights(base.items(), adapter, LORA.alpha / LORA.rank))
    adapted = {f"{module}.weight" for module in adapter_modules(adapter)}
    assert adapted <= set(merged) and len(adapted) > 0
    assert all(merged[name] is base[name] for name in set(base) - adapted), "other tensors pass through"

    merged_dir = Path(shutil.copytree(hf_dir, tmp_path / "merged"))
    save_file(merged, merged_dir / "model.safetensors")  # read by from_pretrained, which fuses MoE experts itself
    merged_model = _model(merged_dir)
    peft_model = PeftModel.from_pretrained(_model(hf_dir), adapter_dir).eval()
    plain = _model(hf_dir)

    input_ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    expected = _logits(peft_model, input_ids)
    assert (expected - _logits(plain, input_ids)).abs().max() > 0.1, "the adapter must move the logits"
    assert (_logits(merged_model, input_ids) - expected).abs().max() <= ATOL


def test_merging_rounds_once_into_the_base_dtype_and_refuses_what_does_not_fit() -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 5, generator=generator).bfloat16()
    a, b = torch.randn(2, 5, generator=generator), torch.randn(6, 2, generator=generator)
    adapter = {"base_model.model.layer.proj.lora_A.weight": a, "base_model.model.layer.proj.lora_B.weight": b}
    ((name, merged),) = merge_lora_weights([("layer.proj.weight", weight)], adapter, 0.5)
    assert name == "layer.proj.weight" and merged.dtype == torch.bfloat16
    assert torch.equal(merged, (weight.float() + 0.5 * (b @ a)).bfloat16())  # float32, one rounding

    with pytest.raises(ValueError, match=r"B @ A is \(6, 5\), the base weight \(5, 6\)"):
        list(merge_lora_weights([("layer.proj.weight", weight.t())], adapter, 0.5))
    with pytest.raises(ValueError, match="has lora_A only"):
        adapter_modules({"base_model.model.layer.proj.lora_A.weight": a})
    with pytest.raises(ValueError, match="is not a PEFT LoRA factor"):
        adapter_modules({"base_model.model.model.layers.0.mlp.experts.lora_A.weight": a})
