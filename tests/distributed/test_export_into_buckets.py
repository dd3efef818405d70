"""The export written into handed-out memory equals the export into its own tensors, bit for bit (TP2 x EP2).

With ``allocate``, every yielded tensor of a CPU parameter is one the allocator handed out, the
parameter's tensors are allocated in one call right before they are yielded, and all of them are
yielded before the next call (what the tensor transport's bucket filler relies on). Both
vocabularies: 100 (padded to 256 at TP 2: the table is converted after the gather) and 256 (no
padding: the table is gathered straight into the handed-out tensor). Both gathers: designated
(to TP rank 0 only) and all-gather.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from megatron_rl.config.hf_config import load_hf_config
from megatron_rl.models.builder import build_qwen_model
from megatron_rl.models.weight_transfer import export_hf_weights, load_hf_weights
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from tests.distributed_utils import run_distributed
from tests.tiny_checkpoints import save_tiny_moe

SIZES = ParallelSizes(tp=2, ep=2, etp=1)


class RecordingAllocator:
    """Hands out NaN-filled tensors and checks each is yielded before the next allocation."""

    def __init__(self) -> None:
        self.pending: list[int] = []
        self.handed_out: set[int] = set()

    def __call__(self, shapes: Sequence[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
        assert not self.pending, "allocated again before yielding what it allocated"
        tensors = [torch.full(shape, float("nan"), dtype=dtype) for shape in shapes]
        self.pending = [t.data_ptr() for t in tensors]
        self.handed_out.update(self.pending)
        return tensors

    def yielded(self, tensor: torch.Tensor) -> None:
        assert tensor.data_ptr() == self.pending.pop(0), "yielded a tensor it was not handed (or out of order)"


def _export_rank(rank: int, world_size: int, hf_dir: Path, designated: bool) -> list[str]:
    initialize_parallel(SIZES)
    arch, _, chunks = build_qwen_model(load_hf_config(hf_dir), SIZES, params_dtype=torch.float32)
    load_hf_weights(chunks, arch, hf_dir)
    own = {name: t.clone() for name, t in export_hf_weights(chunks, arch, designated_only=designated)}
    allocator = RecordingAllocator()
    written = {}
    for name, tensor in export_hf_weights(chunks, arch, designated_only=designated, allocate=allocator):
        allocator.yielded(tensor)
        written[name] = tensor
    destroy_parallel()
    assert not allocator.pending
    assert written.keys() == own.keys()
    return [name for name in own if not torch.equal(own[name], written[name])]


@pytest.mark.parametrize("vocab_size", [100, 256])
@pytest.mark.parametrize("designated", [True, False], ids=["designated", "all_gather"])
def test_export_into_handed_out_memory_is_bit_exact(tmp_path, vocab_size, designated):
    hf_dir = save_tiny_moe(tmp_path / "moe", vocab_size=vocab_size)
    assert run_distributed(_export_rank, 4, hf_dir, designated) == [[], [], [], []]
