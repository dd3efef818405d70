"""Model chunks land on the process's device, with or without Transformer Engine.

On a GPU without Transformer Engine the builder used to keep the chunks on the CPU
(``"cpu"`` unless TE) while batches went to ``select_device()``. The builder now asks
``select_device()`` in both cases; this CPU box has no GPU, so the test points the
builder's ``select_device`` at the meta device and checks every parameter follows it.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config.hf_config import load_hf_config
from megatron_rl.models import builder
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from tests.distributed_utils import run_distributed
from tests.tiny_checkpoints import save_tiny_moe


def _build_on_meta(rank: int, world_size: int, hf_dir) -> set[str]:
    initialize_parallel(ParallelSizes())
    builder.select_device = lambda: torch.device("meta")  # type: ignore[attr-defined]  # builder's own binding
    try:
        _, _, chunks = builder.build_qwen_model(load_hf_config(hf_dir), ParallelSizes(), params_dtype=torch.float32)
        return {p.device.type for chunk in chunks for p in chunk.parameters()}
    finally:
        destroy_parallel()


@pytest.mark.distributed
def test_chunks_follow_select_device_without_transformer_engine(tmp_path):
    assert run_distributed(_build_on_meta, 1, save_tiny_moe(tmp_path / "moe")) == [{"meta"}]
