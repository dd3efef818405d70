"""The torch-free check of a Hugging Face directory's weights knows exactly the tensors transformers writes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from megatron_rl.config.hf_config import load_hf_config, parse_hf_config
from megatron_rl.config.hf_weights import checkpoint_shapes, expected_hf_tensors, weight_problems
from tests.tiny_checkpoints import save_tiny_dense, save_tiny_moe

CHECKPOINTS: dict[str, Callable[[Path], Path]] = {
    "dense-tied": save_tiny_dense,
    "moe-mlp-only-layers": save_tiny_moe,
    "moe-sparse-step": lambda path: save_tiny_moe(path, sparse_step=True),
}


@pytest.mark.parametrize("kind", CHECKPOINTS)
def test_expected_tensors_are_exactly_what_transformers_saves(kind: str, tmp_path: Path) -> None:
    model_dir = CHECKPOINTS[kind](tmp_path / kind)
    arch = parse_hf_config(load_hf_config(model_dir))
    saved = {name: shape for name, (shape, _) in checkpoint_shapes(model_dir).items()}
    assert expected_hf_tensors(arch) == saved
    assert weight_problems(model_dir, arch) == []
