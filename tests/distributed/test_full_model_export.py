"""Every rank exports the whole model, the same sequence everywhere (TP2 x PP2 x EP2 and TP1 x EP4, gloo).

:func:`~megatron_rl.models.weight_transfer.export_full_model` is what each colocated trainer rank
feeds the engine rank on its own device: dense tensors all-gathered over TP, every expert
all-gathered over EP, the stages' tensors broadcast over the pipeline group. Asserted on every
rank: the names are exactly the checkpoint's, each tensor equals the checkpoint's bit for bit,
the order is the same on all ranks (the transport's buckets line up across an engine's feeders),
and with ``allocate`` every tensor is one the allocator handed out, yielded before the next
allocation (what the bucket filler relies on). Asked for some experts (each rank its own, as the
engine ranks of an engine with EP ask), a rank yields the same sequence with only those experts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.config.hf_config import load_hf_config
from megatron_rl.models.builder import build_qwen_model
from megatron_rl.models.weight_map import hf_expert_index
from megatron_rl.models.weight_transfer import export_full_model, load_hf_weights
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from tests.distributed.test_export_into_buckets import RecordingAllocator
from tests.distributed_utils import run_distributed
from tests.tiny_checkpoints import save_tiny_moe


def _export_rank(
    rank: int, world_size: int, hf_dir: Path, sizes: ParallelSizes, experts: list[range] | None = None
) -> tuple[list[str], list[str]]:
    initialize_parallel(sizes)
    arch, _, chunks = build_qwen_model(load_hf_config(hf_dir), sizes, params_dtype=torch.float32)
    load_hf_weights(chunks, arch, hf_dir)
    checkpoint = {name: t for path in sorted(hf_dir.glob("*.safetensors")) for name, t in load_file(path).items()}
    allocator = RecordingAllocator()
    order, differing = [], []
    wanted = None if experts is None else experts[rank % len(experts)]
    for name, tensor in export_full_model(chunks, arch, allocate=allocator, experts=wanted):
        allocator.yielded(tensor)
        order.append(name)
        if not torch.equal(tensor, checkpoint[name]):
            differing.append(name)
    destroy_parallel()
    assert not allocator.pending
    expected = [name for name in checkpoint if wanted is None or hf_expert_index(name) in (None, *wanted)]
    assert sorted(order) == sorted(expected), "not every wanted checkpoint tensor exactly once"
    return order, differing


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("sizes", "world"),
    [(ParallelSizes(tp=2, pp=2, ep=2, etp=1), 8), (ParallelSizes(tp=1, ep=4), 4)],
    ids=["tp2-pp2-ep2", "ep4"],
)
def test_every_rank_exports_the_whole_checkpoint_in_one_order(tmp_path, sizes, world):
    hf_dir = save_tiny_moe(tmp_path / "moe")
    per_rank = run_distributed(_export_rank, world, hf_dir, sizes)
    assert all(differing == [] for _, differing in per_rank)
    assert all(order == per_rank[0][0] for order, _ in per_rank)


@pytest.mark.distributed
def test_ranks_asking_for_different_experts_each_get_the_dense_model_and_only_theirs(tmp_path):
    """TP2 x PP2 x EP2 on 8 ranks, rank r asking for quarter r % 4 of the 4 experts: the stages still broadcast
    every expert, since other stages' ranks want other ones."""
    hf_dir = save_tiny_moe(tmp_path / "moe")
    quarters = [range(e, e + 1) for e in range(4)]
    per_rank = run_distributed(_export_rank, 8, hf_dir, ParallelSizes(tp=2, pp=2, ep=2, etp=1), quarters)
    assert all(differing == [] for _, differing in per_rank)
    for rank, (order, _) in enumerate(per_rank):
        assert [n for n in order if hf_expert_index(n) is None] == [
            n for n in per_rank[0][0] if hf_expert_index(n) is None
        ]
        assert {hf_expert_index(n) for n in order} - {None} == {rank % 4}
