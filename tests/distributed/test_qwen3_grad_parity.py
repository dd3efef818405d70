"""Training path on CPU: Megatron DDP gradients of a token-mean NLL equal transformers' gradients.

Runs Megatron's forward-backward schedule (not forward-only) with
``calculate_per_token_loss`` and ``finalize_model_grads`` (DP / expert-DP
all-reduce, sequence-parallel norm grads over TP, tied-embedding grads across
pipeline stages), maps each ``main_grad`` to Hugging Face names with the same
layouts as the weights, and compares with ``loss.backward()`` in transformers.
Observed max relative error (|diff|_max / |ref|_max per tensor): below 1e-6.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rl.config.hf_config import load_hf_config, parse_hf_config
from megatron_rl.models.builder import build_model_chunks
from megatron_rl.models.megatron_config import build_transformer_config
from megatron_rl.models.weight_transfer import export_hf_tensors, load_hf_weights
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from megatron_rl.parallel.vocab_parallel import vocab_parallel_logprobs_entropy
from tests.distributed_utils import run_distributed
from tests.tiny_checkpoints import VOCAB, checkpoint_named_grads, save_tiny_dense, save_tiny_moe

RTOL = 1e-5
LENGTHS = (8, 5, 3, 7)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.arange(8) < torch.tensor(LENGTHS).unsqueeze(1)
    input_ids = torch.randint(0, VOCAB, mask.shape, generator=torch.Generator().manual_seed(0))
    return input_ids.masked_fill(~mask, 0), mask


def _megatron_grads_rank(rank, world_size, sizes: ParallelSizes, hf_dir: Path) -> dict[str, torch.Tensor]:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    initialize_parallel(sizes)
    arch = parse_hf_config(load_hf_config(hf_dir))
    overrides = {"calculate_per_token_loss": True, "finalize_model_grads_func": finalize_model_grads}
    config = build_transformer_config(arch, sizes, params_dtype=torch.float32, overrides=overrides)
    chunks = build_model_chunks(arch, config)
    load_hf_weights(chunks, arch, hf_dir)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False)
    models = [DistributedDataParallel(config, ddp_config, chunk) for chunk in chunks]
    input_ids, mask = _batch()
    position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    group = parallel_state.get_tensor_model_parallel_group()

    def loss_func(logits: torch.Tensor):
        logprobs, _ = vocab_parallel_logprobs_entropy(logits[:, :-1], input_ids[:, 1:], vocab_size=VOCAB, group=group)
        valid = mask[:, 1:].float()
        return -(logprobs * valid).sum(), valid.sum().long(), {}

    def forward_step(data_iterator, model):
        next(data_iterator)
        return model(input_ids, position_ids, None), loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter([None]) for _ in models] if len(models) > 1 else iter([None]),
        model=models,
        num_microbatches=1,
        seq_length=input_ids.shape[1],
        micro_batch_size=input_ids.shape[0],
        forward_only=False,
    )
    # main_grad: the gradient buffer Megatron's DDP adds to each parameter (torch's Parameter does not declare it)
    grads = {name: grad.clone() for name, grad in export_hf_tensors(chunks, arch, lambda p: p.main_grad)}  # type: ignore[attr-defined]
    destroy_parallel()
    return grads


def _transformers_grads(hf_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    input_ids, mask = _batch()
    logits = model(input_ids, attention_mask=mask.long()).logits
    logprobs = torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    valid = mask[:, 1:].float()
    (-(logprobs * valid).sum() / valid.sum()).backward()
    return checkpoint_named_grads(model)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "model, sizes, world_size",
    [
        pytest.param("moe", ParallelSizes(tp=2, pp=2, ep=2, etp=1), 4, id="moe-tp2-pp2-ep2-etp1"),
        pytest.param("moe", ParallelSizes(tp=2, ep=2, etp=2), 4, id="moe-tp2-pp1-ep2-etp2-dp2"),
        pytest.param("dense", ParallelSizes(pp=2), 2, id="dense-tied-pp2"),
    ],
)
def test_megatron_gradients_match_transformers(model, sizes, world_size, tmp_path):
    hf_dir = (save_tiny_moe if model == "moe" else save_tiny_dense)(tmp_path / model)
    reference = _transformers_grads(hf_dir)
    merged: dict[str, torch.Tensor] = {}
    for grads in run_distributed(_megatron_grads_rank, world_size, sizes, hf_dir):
        merged |= grads
    assert merged.keys() == reference.keys()
    for name, ref in reference.items():
        error = (merged[name] - ref).abs().max() / ref.abs().max()
        assert error < RTOL, f"{name}: relative gradient error {error:.2e}"
