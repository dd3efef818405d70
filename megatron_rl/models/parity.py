"""Megatron vs transformers on one batch: the pieces behind ``check-parity``.

- :func:`make_uneven_batch`: right-padded random token sequences of uneven lengths;
- :func:`reference_outputs`: transformers' logits / per-token log-probs in fp32;
- :func:`megatron_rank_outputs`: per rank, load the checkpoint at a layout, run
  Megatron's forward schedule and return TP-gathered logits (vocab padding
  trimmed) and vocab-parallel log-probs on the last pipeline stage (None elsewhere);
- :func:`max_abs_diffs`: max |difference| over the valid positions;
- :func:`check_parity`: the command itself (local gloo ranks, a printed report).

Shapes: ``input_ids`` / ``mask`` ``[B, S]``; logits ``[B, S, V]``; log-probs ``[B, S-1]``
(token t+1 given the prefix up to t).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.config.hf_config import QwenArchitecture, load_hf_config, parse_hf_config
from megatron_rl.models.builder import build_qwen_model
from megatron_rl.models.forward import forward_logits
from megatron_rl.models.megatron_config import check_layout
from megatron_rl.models.weight_transfer import load_hf_weights
from megatron_rl.parallel.device import collective_backend, on_accelerator, select_device
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from megatron_rl.parallel.local_launch import run_local_ranks
from megatron_rl.parallel.vocab_parallel import vocab_parallel_logprobs_entropy


def make_uneven_batch(
    vocab_size: int, num_sequences: int, max_length: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, mask)``: lengths spread from ``max_length`` down to about a quarter of it."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(max_length, max(2, max_length // 4), num_sequences).round().long()
    mask = torch.arange(max_length) < lengths.unsqueeze(1)
    input_ids = torch.randint(0, vocab_size, (num_sequences, max_length), generator=generator)
    return input_ids.masked_fill(~mask, 0), mask


def _logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def reference_outputs(hf_dir: str | Path, input_ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' fp32 ``{"logits", "logprobs"}`` for the batch (eager attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    logits = model.eval()(input_ids, attention_mask=mask.long()).logits.float()
    return {"logits": logits, "logprobs": _logprobs(logits, input_ids)}


def _gather_vocab(local: torch.Tensor, arch: QwenArchitecture) -> torch.Tensor:
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, local.contiguous(), group=group)
    return torch.cat(shards, dim=-1)[..., : arch.vocab_size]


def megatron_rank_outputs(
    rank: int, world_size: int, sizes: ParallelSizes, hf_dir: str | Path, input_ids: torch.Tensor
) -> dict[str, torch.Tensor] | None:
    """Rank body: Megatron fp32 ``{"logits", "logprobs"}`` on the last stage (on the CPU), else None.

    The batch is split into ``pp`` micro-batches with virtual pipelining
    (Megatron needs at least ``pp`` then), else run as one micro-batch. The model
    runs on this rank's device (:func:`select_device`), ``input_ids`` moved there.
    """
    from megatron.core import parallel_state

    initialize_parallel(sizes)
    try:
        arch, _, chunks = build_qwen_model(load_hf_config(hf_dir), sizes, params_dtype=torch.float32)
        load_hf_weights(chunks, arch, hf_dir)
        input_ids = input_ids.to(select_device())
        outputs = forward_logits(chunks, list(input_ids.chunk(sizes.pp if sizes.vpp else 1)))
        if not outputs:
            return None
        local = torch.cat(outputs, dim=0)
        logprobs, _ = vocab_parallel_logprobs_entropy(
            local[:, :-1],
            input_ids[:, 1:],
            vocab_size=arch.vocab_size,
            group=parallel_state.get_tensor_model_parallel_group(),
        )
        return {"logits": _gather_vocab(local, arch).cpu(), "logprobs": logprobs.cpu()}
    finally:
        destroy_parallel()


def max_abs_diffs(
    ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], mask: torch.Tensor
) -> dict[str, tuple[float, tuple[int, int]]]:
    """``{key: (max |diff|, (sequence, position) where it occurs)}`` over valid positions."""
    report = {}
    for key, valid in (("logits", mask), ("logprobs", mask[:, 1:])):
        diff = (ours[key] - reference[key]).abs()
        per_position = diff.amax(dim=-1) if diff.dim() == 3 else diff
        per_position = per_position.masked_fill(~valid, 0.0)
        flat = int(per_position.argmax())
        where = (flat // per_position.shape[1], flat % per_position.shape[1])
        report[key] = (float(per_position.max()), where)
    return report


def check_parity(
    hf_dir: str | Path,
    sizes: ParallelSizes,
    *,
    tolerance: float = 1e-4,
    num_sequences: int = 4,
    max_length: int = 32,
) -> bool:
    """Compare Megatron at ``sizes`` with transformers in fp32; print a report; True when within tolerance."""
    arch = parse_hf_config(load_hf_config(hf_dir))
    check_layout(arch, sizes)
    max_length += -max_length % (sizes.tp * (2 * sizes.cp if sizes.cp > 1 else 1))  # SP, and CP's 2*cp chunks
    num_sequences += -num_sequences % sizes.pp
    input_ids, mask = make_uneven_batch(arch.vocab_size, num_sequences, max_length)
    world_size = sizes.min_world_size
    print(
        f"model:  {arch.architecture}, {arch.num_layers} layers, hidden {arch.hidden_size}, vocab {arch.vocab_size}"
        + (f", {arch.num_experts} experts (top-{arch.moe_router_topk})" if arch.is_moe else "")
    )
    print(
        f"layout: TP={sizes.tp} PP={sizes.pp} VPP={sizes.vpp or '-'} CP={sizes.cp} EP={sizes.ep} ETP={sizes.expert_tp} "
        f"on {world_size} {'GPU' if on_accelerator() else 'CPU'} rank(s), {collective_backend()}, fp32"
    )
    print(f"batch:  {num_sequences} sequences, lengths {mask.sum(1).tolist()}")
    reference = reference_outputs(hf_dir, input_ids, mask)
    outputs = run_local_ranks(megatron_rank_outputs, world_size, sizes, Path(hf_dir), input_ids)
    ours = next(out for out in outputs if out is not None)
    passed = True
    for key, (diff, (sequence, position)) in max_abs_diffs(ours, reference, mask).items():
        ok = diff <= tolerance
        passed &= ok
        print(
            f"max |{key} diff| = {diff:.3e}  at sequence {sequence}, position {position}  "
            f"{'ok' if ok else 'ABOVE TOLERANCE'}"
        )
    print(f"tolerance {tolerance:.0e}: {'PASS' if passed else 'FAIL'}")
    return passed
