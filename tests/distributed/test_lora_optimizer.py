"""Megatron's DDP and distributed optimizer (``actor/optimizer.py`` as the actor builds them) over a model with
LoRA adapters, at TP2 x EP2 (sequence parallel, 4 gloo ranks, fp32).

megatron-core 0.19 builds its gradient buffers, and so the optimizer's parameters and state, from the
parameters with ``requires_grad`` only (``DistributedDataParallel.__init__``), so freezing the base in
``apply_lora`` is all it needs: the buffers hold exactly the adapters, a step leaves the base bitwise as it was,
and ``finalize_model_grads`` keeps the whole (replicated) factors identical over TP through their
``sequence_parallel`` flag.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_rl.actor.optimizer import build_optimizer, step_optimizer, wrap_ddp
from megatron_rl.config.hf_config import load_hf_config, parse_hf_config
from megatron_rl.config.schema import LoRAConfig
from megatron_rl.models.builder import build_model_chunks
from megatron_rl.models.lora import apply_lora, lora_modules
from megatron_rl.models.lora_peft import peft_to_lora_state
from megatron_rl.models.megatron_config import build_transformer_config
from megatron_rl.models.weight_transfer import load_hf_weights
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from tests.actor_setup import train_config
from tests.distributed_utils import run_distributed
from tests.lora_adapters import random_peft_adapter
from tests.tiny_checkpoints import VOCAB, save_tiny_moe

LORA = LoRAConfig(rank=2, alpha=4.0)
SIZES = ParallelSizes(tp=2, ep=2, etp=1)


def _step_rank(rank: int, world_size: int, hf_dir: Path, adapter: dict[str, torch.Tensor]) -> dict:
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads

    initialize_parallel(SIZES)
    arch = parse_hf_config(load_hf_config(hf_dir))
    config = build_transformer_config(arch, SIZES, params_dtype=torch.float32)
    chunks = build_model_chunks(arch, config)
    apply_lora(chunks, arch, LORA)
    load_hf_weights(chunks, arch, hf_dir)
    peft_to_lora_state(chunks, adapter, arch.num_experts)
    adapters = {id(p) for m in lora_modules(chunks) for p in (*m.lora_A.values(), *m.lora_B.values())}
    models = wrap_ddp(config, chunks)
    bundle = build_optimizer(models, train_config(lr=0.1), torch.float32)
    buffered = [p for model in models for b in model.buffers + model.expert_parallel_buffers for p in b.params]
    before = {name: p.detach().clone() for name, p in chunks[0].named_parameters()}

    input_ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank() // 2))
    logits = models[0](input_ids, torch.arange(8).expand(2, -1), None)
    (logits.float() ** 2).mean().backward()
    finalize_model_grads(models)
    metrics = step_optimizer(bundle)

    after = dict(chunks[0].named_parameters())
    changed = {name for name, p in after.items() if not torch.equal(p.detach(), before[name])}
    dense = [m for m in lora_modules(chunks) if not m.expert]  # the TP group's ranks hold other experts
    whole = [p.detach() for m in dense for p in (m.lora_B if m.row_parallel else m.lora_A).values()]
    group = parallel_state.get_tensor_model_parallel_group()
    replicas = [torch.cat([t.flatten() for t in whole]) for _ in range(dist.get_world_size(group))]
    dist.all_gather(replicas, torch.cat([t.flatten() for t in whole]), group=group)
    result = {
        "buffered_are_adapters": {id(p) for p in buffered} == adapters,
        "changed": changed,
        "adapter_names": {name for name, p in after.items() if id(p) in adapters},
        "whole_equal_over_tp": all(torch.equal(replicas[0], r) for r in replicas),
        "skipped": metrics["update_skipped"],
    }
    destroy_parallel()
    return result


@pytest.mark.distributed
def test_distributed_optimizer_holds_and_updates_only_the_adapters(tmp_path):
    hf_dir = save_tiny_moe(tmp_path / "moe", all_sparse=True)
    arch = parse_hf_config(load_hf_config(hf_dir))
    for result in run_distributed(_step_rank, 4, hf_dir, random_peft_adapter(arch, LORA, seed=3)):
        assert result["buffered_are_adapters"], "DDP's buffers (the optimizer's parameters) are the adapters"
        assert result["skipped"] == 0.0
        assert result["changed"], "the step moved the adapters"
        assert result["changed"] <= result["adapter_names"], "the base stays bitwise as it was"
        assert result["whole_equal_over_tp"]
