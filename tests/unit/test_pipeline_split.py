"""Our torch-free pipeline split (megatron_rl.config.pipeline_split) against Megatron-core's own.

For every split Megatron accepts, each (stage, chunk) holds the layers ``get_transformer_layer_offset`` and
``get_num_layers_to_build`` give; every split Megatron's ``TransformerConfig`` refuses, ours names a problem.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_rl.config.pipeline_split import PipelineSplit

CASES = [
    PipelineSplit(layers, pp, vpp, first, last)
    for layers, pp, vpp, first, last in itertools.product(
        (6, 8, 12, 94), (2, 3, 4, 8), (None, 2), (None, 1, 2, 4, 11), (None, 1, 2, 4, 11)
    )
]


def _megatron_config(split: PipelineSplit) -> TransformerConfig:
    return TransformerConfig(
        num_layers=split.num_layers,
        hidden_size=16,
        num_attention_heads=2,
        pipeline_model_parallel_size=split.pp,
        virtual_pipeline_model_parallel_size=split.vpp,
        num_layers_in_first_pipeline_stage=split.first,
        num_layers_in_last_pipeline_stage=split.last,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
    )


def _megatron_chunks(split: PipelineSplit) -> list[range] | None:
    """Megatron's layers per (stage, chunk), stage-major; None when it refuses the split or fails on it."""
    try:
        config = _megatron_config(split)
        chunks = []
        for pp_rank in range(split.pp):
            for vp_stage in range(split.vpp or 1):
                stage = vp_stage if split.vpp else None
                start = get_transformer_layer_offset(config, vp_stage=stage, pp_rank=pp_rank)
                chunks.append(range(start, start + get_num_layers_to_build(config, vp_stage=stage, pp_rank=pp_rank)))
    except (ValueError, AssertionError, ZeroDivisionError):
        return None
    return chunks if sorted(layer for chunk in chunks for layer in chunk) == list(range(split.num_layers)) else None


ACCEPTED = [split for split in CASES if split.problem() is None]


@pytest.mark.parametrize("split", ACCEPTED, ids=str)
def test_each_chunk_holds_the_layers_megatron_builds_there(split: PipelineSplit) -> None:
    ours = [split.chunk_layers(pp_rank, vp_stage) for pp_rank in range(split.pp) for vp_stage in range(split.vpp or 1)]
    assert ours == _megatron_chunks(split)


def test_every_split_megatron_cannot_build_is_refused() -> None:
    """Ours also refuses splits Megatron accepts but builds wrong (layers lost or repeated) or divides by zero on."""
    unbuildable = [split for split in CASES if _megatron_chunks(split) is None]
    assert unbuildable and all(split.problem() is not None for split in unbuildable)
    assert len(ACCEPTED) + len(unbuildable) == len(CASES)


def test_qwen3_235b_splits_as_nemo_rl_runs_it():
    """94 layers over PP8 with 11 in the first and last stages: 12 in each of the six others."""
    split = PipelineSplit(94, 8, first=11, last=11)
    assert [len(split.chunk_layers(rank)) for rank in range(8)] == [11] + [12] * 6 + [11]
    assert PipelineSplit(94, 8).problem() is not None
