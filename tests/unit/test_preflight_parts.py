"""Preflight's parts that need no cluster: the model cut, the GEMM error bound, naming faulty or slow GPUs, and
merging each rank's collective timings."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from megatron_rl.config import load_recipe, read_architecture
from megatron_rl.config.hf_weights import weight_problems
from megatron_rl.models.safetensors_reader import SafetensorsCheckpoint
from megatron_rl.preflight.cluster import _bandwidths, _gemm_faults
from megatron_rl.preflight.cut_model import cut_depth, cut_model, write_cut_checkpoint
from megatron_rl.preflight.device_probe import _gemm_error_bound
from tests.tiny_checkpoints import save_tiny_moe

ROOT = Path(__file__).resolve().parents[2]


def test_the_cut_checkpoint_keeps_the_first_layers_real_weights_and_every_other_tensor(tmp_path: Path) -> None:
    source = save_tiny_moe(tmp_path / "full")  # 4 layers, layer 1 dense
    write_cut_checkpoint(source, tmp_path / "cut", 2)
    config = json.loads((tmp_path / "cut" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["mlp_only_layers"] == [1]
    full, cut = SafetensorsCheckpoint(source), SafetensorsCheckpoint(tmp_path / "cut")
    expected = [n for n in full.names() if not n.startswith(("model.layers.2.", "model.layers.3."))]
    assert sorted(cut.names()) == sorted(expected)
    for name in expected:
        assert torch.equal(cut.read(name), full.read(name)), name
    assert weight_problems(tmp_path / "cut", read_architecture(str(tmp_path / "cut"), None)) == []
    assert not (tmp_path / "cut.partial").exists()
    with safe_open(tmp_path / "cut" / "model.safetensors", framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}


def test_the_cut_is_one_layer_per_pipeline_chunk_and_never_deeper_than_the_model(tmp_path: Path) -> None:
    cfg, _ = load_recipe(
        ROOT / "recipes" / "qwen3_30b_a3b_dapo.yaml",
        ["parallel.pp=4", "parallel.vpp=2", "weight_sync.transport=disk"],
        require_files=False,
    )
    assert cut_depth(cfg, 48) == 8 and cut_depth(cfg, 6) == 6
    tiny, _ = load_recipe(ROOT / "recipes" / "tiny_moe_cpu_dapo.yaml", [], require_files=False)
    assert cut_depth(tiny, 2) == 2
    cut = cut_model(tiny, 2, tmp_path)
    assert "model.random_init.num_hidden_layers=2" in cut.overrides and not (tmp_path / "cut_model").exists()


def test_the_gemm_bound_holds_a_bf16_product_and_catches_a_wrong_element() -> None:
    generator = torch.Generator().manual_seed(0)
    size = 128
    a = torch.randn(size, size, generator=generator).bfloat16()
    b = torch.randn(size, size, generator=generator).bfloat16()
    reference, scale = a.double() @ b.double(), a.double().abs() @ b.double().abs()
    product = (a @ b).double()
    bound = _gemm_error_bound(torch.bfloat16, size) * scale
    assert bool(((product - reference).abs() <= bound).all())
    product[3, 5] += 4 * bound[3, 5]  # one element off, as a faulty GPU's
    assert int(((product - reference).abs() > bound).sum()) == 1


def _gemm(rank: int, tflops: float, ok: bool = True) -> dict[str, object]:
    return {
        "where": f"rank {rank} (node1:gpu{rank})",
        "tflops": tflops,
        "ok": ok,
        "max_error_ratio": 1.0 if ok else 9.0,
    }


def test_a_wrong_or_slow_gpu_is_named_and_a_sound_set_is_not() -> None:
    assert _gemm_faults([_gemm(r, 700.0 + r) for r in range(8)]) == []
    faults = _gemm_faults([_gemm(0, 700.0), _gemm(1, 300.0), _gemm(2, 710.0, ok=False), _gemm(3, 705.0)])
    assert len(faults) == 2
    assert faults[0].startswith("rank 2 (node1:gpu2): GEMM off by 9x")
    assert faults[1].startswith("rank 1 (node1:gpu1): 300.0 TFLOP/s, below 50% of the median")


def test_bandwidths_keep_the_slowest_rank_of_each_collective_and_whether_a_group_spans_nodes() -> None:
    def entry(rank: int, gbps: float, spans: bool) -> dict[str, object]:
        where = f"rank {rank}"
        return {
            "group": "dp",
            "collective": "all-reduce",
            "size": 2,
            "spans_nodes": spans,
            "bus_gbps": gbps,
            "where": where,
        }

    merged = _bandwidths([[entry(0, 40.0, False)], [entry(1, 25.0, True)], [entry(2, 30.0, False)]])
    assert merged == [
        {"group": "dp", "collective": "all-reduce", "size": 2, "spans_nodes": True, "bus_gbps": 25.0, "where": "rank 1"}
    ]
