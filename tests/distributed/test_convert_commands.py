"""convert hf-to-mcore / mcore-to-hf and check-parity, end to end on tiny checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from megatron_rl.checkpoint import convert
from megatron_rl.checkpoint.convert import convert_hf_to_mcore, convert_mcore_to_hf
from megatron_rl.cli import main
from megatron_rl.config.hf_config import load_hf_config
from megatron_rl.models.builder import build_qwen_model
from megatron_rl.models.hf_export import write_hf_model_dir
from megatron_rl.models.hf_files import partial_dir
from megatron_rl.models.safetensors_reader import SafetensorsCheckpoint
from megatron_rl.models.weight_transfer import load_hf_weights
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from megatron_rl.parallel.errors import RankFailedError
from tests.distributed_utils import run_distributed
from tests.tiny_checkpoints import save_tiny_dense, save_tiny_moe


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    path = save_tiny_moe(tmp_path_factory.mktemp("hf") / "moe")
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    return path


@pytest.mark.distributed
def test_hf_to_torch_dist_to_hf_round_trip_is_bit_identical(tmp_path, moe_dir):
    convert_hf_to_mcore(moe_dir, tmp_path / "mcore", ParallelSizes(tp=2, ep=2))
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "hf", ParallelSizes(pp=2, ep=2), max_shard_bytes=40_000)

    original, converted = load_file(moe_dir / "model.safetensors"), SafetensorsCheckpoint(tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert sorted(converted.names()) == sorted(original)
    assert all(torch.equal(converted.read(name), tensor) for name, tensor in original.items())
    for name in ("config.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (moe_dir / name).read_bytes()
    AutoModelForCausalLM.from_pretrained(tmp_path / "hf")


def _cli_rank(rank: int, world_size: int, argv: list[str]) -> int:
    return main(argv)


@pytest.mark.distributed
def test_converters_run_as_the_ranks_of_an_externally_launched_job(tmp_path, moe_dir):
    to_mcore = ["convert", "hf-to-mcore", "--hf", str(moe_dir), "--out", str(tmp_path / "mcore"), "--pp", "2"]
    to_hf = [
        "convert",
        "mcore-to-hf",
        "--ckpt",
        str(tmp_path / "mcore"),
        "--out",
        str(tmp_path / "hf"),
        "--tp",
        "2",
        "--ep",
        "2",
        "--etp",
        "1",
    ]
    assert run_distributed(_cli_rank, 2, to_mcore) == [0, 0]
    assert run_distributed(_cli_rank, 4, to_hf) == [0, 0, 0, 0]
    original, converted = load_file(moe_dir / "model.safetensors"), SafetensorsCheckpoint(tmp_path / "hf")
    assert sorted(converted.names()) == sorted(original)
    assert all(torch.equal(converted.read(name), tensor) for name, tensor in original.items())
    assert not partial_dir(tmp_path / "hf").exists()


@pytest.mark.distributed
def test_bfloat16_checkpoint_round_trips_bit_identically_in_bfloat16(tmp_path):
    hf_dir = save_tiny_moe(tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((hf_dir / "config.json").read_text())["dtype"] == "bfloat16"
    convert_hf_to_mcore(hf_dir, tmp_path / "mcore", ParallelSizes(tp=2, ep=2))
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "hf")
    original, converted = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert converted.keys() == original.keys()
    assert all(converted[n].dtype == torch.bfloat16 and torch.equal(converted[n], original[n]) for n in original)


def _write_from_bfloat16_chunks(rank: int, world_size: int, hf_dir: Path, out_dir: Path) -> None:
    sizes = ParallelSizes(ep=2)
    initialize_parallel(sizes)
    try:
        arch, _, chunks = build_qwen_model(load_hf_config(hf_dir), sizes, params_dtype=torch.bfloat16)
        load_hf_weights(chunks, arch, hf_dir)
        write_hf_model_dir(chunks, arch, hf_dir, out_dir)
    finally:
        destroy_parallel()


@pytest.mark.distributed
def test_weights_trained_in_bfloat16_are_written_in_the_config_dtype(tmp_path, moe_dir):
    run_distributed(_write_from_bfloat16_chunks, 2, moe_dir, tmp_path / "hf")
    original, written = load_file(moe_dir / "model.safetensors"), SafetensorsCheckpoint(tmp_path / "hf")
    assert sorted(written.names()) == sorted(original)
    for name, tensor in original.items():
        assert written.read(name).dtype == torch.float32, name
        assert torch.equal(written.read(name), tensor.to(torch.bfloat16).to(torch.float32)), name


@pytest.mark.distributed
def test_tied_dense_round_trip_keeps_only_the_embedding(tmp_path):
    dense = save_tiny_dense(tmp_path / "dense")
    convert_hf_to_mcore(dense, tmp_path / "mcore", ParallelSizes(pp=2))
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "hf")
    original, converted = load_file(dense / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert "lm_head.weight" not in converted
    assert converted.keys() == original.keys()
    assert all(torch.equal(converted[name], original[name]) for name in original)


@pytest.mark.distributed
def test_failed_conversion_leaves_nothing_at_out(tmp_path, moe_dir, monkeypatch):
    bad = tmp_path / "bad"
    bad.mkdir()
    tensors = load_file(moe_dir / "model.safetensors")
    tensors.pop("model.norm.weight")
    save_file(tensors, bad / "model.safetensors")
    (bad / "config.json").write_bytes((moe_dir / "config.json").read_bytes())
    with pytest.raises(ValueError, match="--hf: .*are missing: model.norm.weight"):
        convert_hf_to_mcore(bad, tmp_path / "out")  # the headers are checked before any rank starts
    assert not (tmp_path / "out").exists() and not partial_dir(tmp_path / "out").exists()
    monkeypatch.setattr(convert, "weight_problems", lambda *args: [])  # the ranks find it too, and clean up
    with pytest.raises(RankFailedError, match="rank 0 failed: .*model.norm.weight.* is missing"):
        convert_hf_to_mcore(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not partial_dir(tmp_path / "out").exists()


@pytest.mark.distributed
def test_cli_reports_a_bad_checkpoint_in_one_line_and_exits_2(tmp_path, moe_dir, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((moe_dir / "config.json").read_text()) | {"num_local_experts": 8}
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").write_bytes((moe_dir / "model.safetensors").read_bytes())
    assert main(["convert", "hf-to-mcore", "--hf", str(bad), "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert "model.layers.0.mlp.gate.weight" in error and "[4, 32]" in error and "[8, 32]" in error


def test_conversion_refuses_a_non_empty_out(tmp_path, moe_dir):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        convert_hf_to_mcore(moe_dir, tmp_path / "out")


@pytest.mark.distributed
def test_check_parity_prints_max_diffs_and_exits_zero_within_tolerance(moe_dir, capsys):
    assert main(["check-parity", "--hf", str(moe_dir), "--tp", "2", "--ep", "2", "--etp", "1"]) == 0
    report = capsys.readouterr().out
    assert "max |logits diff|" in report and "max |logprobs diff|" in report and "PASS" in report


@pytest.mark.distributed
def test_check_parity_exits_non_zero_above_tolerance(moe_dir, capsys):
    assert main(["check-parity", "--hf", str(moe_dir), "--tolerance", "1e-12"]) == 1
    assert "FAIL" in capsys.readouterr().out
