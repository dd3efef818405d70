"""Importing Hugging Face safetensors: ranks read only their slices; sharded checkpoints work;
bad checkpoints fail naming the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from megatron_rl.config.hf_config import load_hf_config, parse_hf_config
from megatron_rl.models.builder import build_model_chunks
from megatron_rl.models.megatron_config import build_transformer_config
from megatron_rl.models.safetensors_reader import CheckpointTensorError, SafetensorsCheckpoint
from megatron_rl.models.weight_transfer import export_hf_weights, load_hf_weights
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from tests.distributed_utils import run_distributed
from tests.tiny_checkpoints import save_tiny_moe


def _import_rank(rank: int, world_size: int, hf_dir: Path) -> dict[str, torch.Tensor] | str:
    initialize_parallel(ParallelSizes(tp=world_size))
    arch = parse_hf_config(load_hf_config(hf_dir))
    config = build_transformer_config(arch, ParallelSizes(tp=world_size), params_dtype=torch.float32)
    chunks = build_model_chunks(arch, config)
    try:
        load_hf_weights(chunks, arch, hf_dir)
        return dict(export_hf_weights(chunks, arch))
    except CheckpointTensorError as error:
        return str(error)
    finally:
        destroy_parallel()


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return save_tiny_moe(tmp_path_factory.mktemp("hf") / "moe")


class _CountingCheckpoint(SafetensorsCheckpoint):
    """The real reader, also counting the elements it reads from disk."""

    elements_read = 0

    def read(self, name, rows=None, cols=None):
        tensor = super().read(name, rows, cols)
        self.elements_read += tensor.numel()
        return tensor


def _count_reads_rank(rank: int, world_size: int, sizes: ParallelSizes, hf_dir: Path) -> int:
    initialize_parallel(sizes)
    arch = parse_hf_config(load_hf_config(hf_dir))
    chunks = build_model_chunks(arch, build_transformer_config(arch, sizes, params_dtype=torch.float32))
    checkpoint = _CountingCheckpoint(hf_dir)
    load_hf_weights(chunks, arch, checkpoint)
    destroy_parallel()
    return checkpoint.elements_read


@pytest.mark.distributed
def test_each_rank_reads_only_its_slices(moe_dir):
    tensors = load_file(moe_dir / "model.safetensors")
    total = sum(t.numel() for t in tensors.values())
    replicated = sum(t.numel() for n, t in tensors.items() if n.endswith(("norm.weight", "mlp.gate.weight")))
    single = run_distributed(_count_reads_rank, 1, ParallelSizes(), moe_dir)[0]
    per_rank = run_distributed(_count_reads_rank, 4, ParallelSizes(tp=2, ep=2, etp=1), moe_dir)
    assert single == total
    assert max(per_rank) < 0.6 * total
    # World 4 at TP2 EP2 ETP1: every sharded element has exactly 2 holders (DP2 for
    # dense, expert-DP2 for experts); replicated tensors (norms, router) have 4.
    assert sum(per_rank) == 2 * (total - replicated) + 4 * replicated


@pytest.mark.distributed
def test_sharded_checkpoint_with_index_imports_like_the_single_file(tmp_path, moe_dir):
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    exported = run_distributed(_import_rank, 2, tmp_path)[0]
    on_disk = load_file(moe_dir / "model.safetensors")
    assert all(torch.equal(exported[name], on_disk[name]) for name in on_disk)


def _rewrite(moe_dir: Path, out: Path, edit) -> Path:
    out.mkdir()
    tensors = load_file(moe_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(load_hf_config(moe_dir)))
    return out


@pytest.mark.distributed
def test_missing_tensor_is_reported_by_name(tmp_path, moe_dir):
    bad = _rewrite(moe_dir, tmp_path / "bad", lambda t: t.pop("model.layers.2.mlp.experts.3.up_proj.weight"))
    message = run_distributed(_import_rank, 1, bad)[0]
    assert "model.layers.2.mlp.experts.3.up_proj.weight" in message and "missing" in message


@pytest.mark.distributed
def test_wrong_shape_is_reported_with_expected_shape(tmp_path, moe_dir):
    def shrink(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"][:16]

    bad = _rewrite(moe_dir, tmp_path / "bad", shrink)
    message = run_distributed(_import_rank, 2, bad)[0]
    assert "model.layers.0.self_attn.k_proj.weight" in message and "[16, 32]" in message and "[32, 32]" in message
