"""LoRA adapters on Megatron (CPU, gloo, fp32) vs transformers + ``peft``'s ``PeftModel``.

A random adapter (every A and B nonzero) on all seven targets is written as a PEFT adapter, loaded into the
Megatron model (each rank taking its shard) and into ``PeftModel.from_pretrained``; logits must agree on
the valid positions, and the Megatron export must give back the adapter bit for bit.

Model: the tiny Qwen3-MoE with every layer sparse. PEFT 0.21 on transformers v5 maps the MLP targets of a
MoE model to the fused experts' parameters only (``_convert_peft_config_moe`` drops gate/up/down_proj from
``target_modules``), so it would leave a dense layer's MLP (``mlp_only_layers``) unadapted; the dense
Qwen3 model covers the dense MLP's adapter instead.

Tolerance: ATOL = 1e-5 is asserted (the issue asks for 1e-4). The adapter adds one rank-r product per
projection to the same fp32 arithmetic whose base logits agree within 1.7e-6 (``test_qwen3_parity``);
with B ~ 0.1 the update moves the logits by O(1) (asserted > 0.1), so the rounding stays of the same order.
Observed max |logit diff| (2026-12, CPU): 1.1e-6 (MoE TP2 x EP2), 9.5e-7 (MoE PP2), 1.7e-6 (dense TP2).

Gradients (TP2 x EP2 at expert TP 1 and 2, sequence parallel, each DP rank running its rows):
GRAD_RTOL = 1e-5 of the largest gradient is asserted; observed 2.7e-5 (ETP 1) and 2.5e-5 (ETP 2) on a
largest gradient of 82 (3e-7 relative). Leaving out the TP all-reduce of the ``sequence_parallel``
factors gives 11.7, and leaving out the expert-TP sum of the experts' whole factors 8.1: the check has
teeth.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from megatron_rl.config.hf_config import load_hf_config, parse_hf_config
from megatron_rl.config.schema import LoRAConfig
from megatron_rl.models.builder import build_model_chunks
from megatron_rl.models.forward import forward_logits
from megatron_rl.models.lora import apply_lora
from megatron_rl.models.lora_peft import (
    lora_state_to_peft,
    peft_adapter_config,
    peft_to_lora_state,
    unfuse_peft_experts,
)
from megatron_rl.models.megatron_config import build_transformer_config
from megatron_rl.models.weight_transfer import load_hf_weights
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from tests.distributed_utils import run_distributed
from tests.lora_adapters import random_peft_adapter
from tests.tiny_checkpoints import VOCAB, save_tiny_dense, save_tiny_moe

ATOL = 1e-5
GRAD_RTOL = 1e-5
LENGTHS = (8, 5, 3, 7)
SEQ = 8
LORA = LoRAConfig(rank=4, alpha=8.0)

LAYOUTS = [
    pytest.param(ParallelSizes(tp=2, ep=2, etp=1), 4, "moe", id="moe-tp2-ep2"),
    pytest.param(ParallelSizes(tp=2, ep=2, etp=2), 4, "moe", id="moe-tp2-ep2-etp2"),
    pytest.param(ParallelSizes(pp=2), 2, "moe", id="moe-pp2"),
    pytest.param(ParallelSizes(tp=2), 2, "dense", id="dense-tp2"),
]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    dirs = {"moe": save_tiny_moe(root / "moe", all_sparse=True), "dense": save_tiny_dense(root / "dense")}
    for hf_dir in dirs.values():
        adapter = hf_dir / "adapter"
        adapter.mkdir()
        arch = parse_hf_config(load_hf_config(hf_dir))
        save_file(random_peft_adapter(arch, LORA, seed=1), adapter / "adapter_model.safetensors")
        (adapter / "adapter_config.json").write_text(json.dumps(peft_adapter_config(LORA, str(hf_dir))))
    return dirs


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, VOCAB, (len(LENGTHS), SEQ), generator=generator)
    mask = torch.arange(SEQ) < torch.tensor(LENGTHS).unsqueeze(1)
    return input_ids.masked_fill(~mask, 0), mask


def _adapted_model(sizes: ParallelSizes, hf_dir: Path) -> list:
    """This rank's chunks at ``sizes`` with the checkpoint's base weights and ``hf_dir/adapter``'s adapter."""

    initialize_parallel(sizes)
    arch = parse_hf_config(load_hf_config(hf_dir))
    chunks = build_model_chunks(arch, build_transformer_config(arch, sizes, params_dtype=torch.float32))
    apply_lora(chunks, arch, LORA)
    load_hf_weights(chunks, arch, hf_dir)  # the base weights' map sees through the LoRA wrappers
    peft_to_lora_state(chunks, load_file(hf_dir / "adapter" / "adapter_model.safetensors"), arch.num_experts)
    return chunks


def _megatron_rank(rank: int, world_size: int, sizes: ParallelSizes, hf_dir: Path, input_ids: torch.Tensor) -> dict:
    from megatron.core import parallel_state

    chunks = _adapted_model(sizes, hf_dir)
    outputs = forward_logits(chunks, [input_ids])
    result: dict = {"export": lora_state_to_peft(chunks)}
    if outputs:
        local = outputs[0]
        group = parallel_state.get_tensor_model_parallel_group()
        shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shards, local.contiguous(), group=group)
        result["logits"] = torch.cat(shards, dim=-1)[..., :VOCAB]
    destroy_parallel()
    return result


def _peft_logits(hf_dir: Path, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    model = PeftModel.from_pretrained(base, hf_dir / "adapter").eval()
    with torch.no_grad():
        return model(input_ids, attention_mask=mask.long()).logits.float()


@pytest.mark.distributed
@pytest.mark.parametrize("sizes, world_size, model", LAYOUTS)
def test_megatron_lora_matches_peft_and_exports_the_adapter(sizes, world_size, model, adapters):

    input_ids, mask = _batch()
    hf_dir = adapters[model]
    per_rank = run_distributed(_megatron_rank, world_size, sizes, hf_dir, input_ids)
    reference = _peft_logits(hf_dir, input_ids, mask)
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        base_logits = base(input_ids, attention_mask=mask.long()).logits
    assert (reference - base_logits)[mask].abs().max() > 0.1, "the adapter must move the logits"
    last_stage = [r["logits"] for r in per_rank if "logits" in r]
    assert last_stage
    for logits in last_stage:
        diff = (logits - reference)[mask].abs().max().item()
        assert diff < ATOL, f"max |logit diff| {diff:.2e} >= {ATOL}"
    written = load_file(hf_dir / "adapter" / "adapter_model.safetensors")
    for result in per_rank:
        assert set(result["export"]) == set(written)
        assert all(torch.equal(result["export"][n], written[n]) for n in written)


def _loss_weights(shape: tuple[int, ...], mask: torch.Tensor) -> torch.Tensor:
    """Fixed random weights of a loss linear in the logits, zero on padded positions."""
    weights = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    return weights * mask.unsqueeze(-1)


def _megatron_grads(rank: int, world_size: int, sizes: ParallelSizes, hf_dir: Path, input_ids, mask) -> dict:
    """Whole adapter gradients of ``sum(logits * weights)`` over the batch, each DP rank running its rows.

    Reduced as ``finalize_model_grads`` does, without its loss scaling: summed over the parameter's DP group
    (expert DP for experts) and, for the ``sequence_parallel`` factors, over TP.
    """
    from megatron.core import parallel_state as ps

    chunks = _adapted_model(sizes, hf_dir)
    rows = input_ids.chunk(ps.get_data_parallel_world_size())[ps.get_data_parallel_rank()]
    first = ps.get_data_parallel_rank() * rows.shape[0]
    local = chunks[0](rows, torch.arange(rows.shape[1]).expand_as(rows), None)
    start, width = ps.get_tensor_model_parallel_rank() * local.shape[-1], local.shape[-1]
    whole = _loss_weights((*input_ids.shape, VOCAB), mask)[first : first + rows.shape[0]]
    weights = torch.zeros_like(local)
    weights[..., : max(0, min(width, VOCAB - start))] = whole[..., start : start + width]
    (local * weights).sum().backward()
    with torch.no_grad():
        for param in chunks[0].parameters():
            if param.requires_grad:
                expert = not getattr(param, "allreduce", True)
                dist.all_reduce(
                    param.grad, group=ps.get_expert_data_parallel_group() if expert else ps.get_data_parallel_group()
                )
                if getattr(param, "sequence_parallel", False):
                    dist.all_reduce(param.grad, group=ps.get_tensor_model_parallel_group())
                param.copy_(param.grad)
    grads = lora_state_to_peft(chunks)
    destroy_parallel()
    return grads


@pytest.mark.distributed
@pytest.mark.parametrize("etp", [1, 2])
def test_adapter_gradients_match_peft_at_tp2_ep2(etp, adapters):
    """The adapters' gradients of a loss linear in the logits, gathered whole, are PEFT's (the backward of the
    TP mappings on the low-rank activation, with SP, is exact; with expert TP 2 so are the experts')."""
    input_ids, mask = _batch()
    hf_dir = adapters["moe"]
    megatron, *_ = run_distributed(_megatron_grads, 4, ParallelSizes(tp=2, ep=2, etp=etp), hf_dir, input_ids, mask)
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    model = PeftModel.from_pretrained(base, hf_dir / "adapter", is_trainable=True)
    logits = model(input_ids, attention_mask=mask.long()).logits
    (logits * _loss_weights(tuple(logits.shape), mask)).sum().backward()
    named = {n.replace(".default.", "."): p.grad for n, p in model.named_parameters() if p.grad is not None}
    reference = unfuse_peft_experts(named, parse_hf_config(load_hf_config(hf_dir)).num_experts)
    assert set(megatron) == set(reference)
    scale = max(g.abs().max().item() for g in reference.values())
    diff = max((megatron[n] - reference[n]).abs().max().item() for n in reference)
    assert diff < GRAD_RTOL * scale, f"max |grad diff| {diff:.2e} vs max |grad| {scale:.2e}"
