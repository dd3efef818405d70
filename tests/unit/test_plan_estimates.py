"""`megatron-rl plan`'s modelled GPU figures: FLOPs and bytes by hand, the rate ranges, the 30B recipe's report."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.cli import main
from megatron_rl.config import load_recipe
from megatron_rl.config.schema import ParallelConfig
from megatron_rl.plan.estimates import (
    EXPORT_MICROSECONDS_PER_TENSOR,
    FS_READ_GBPS,
    FS_WRITE_GBPS,
    GENERATION_MFU,
    LOAD_MICROSECONDS_PER_TENSOR,
    NETWORK_GBPS,
    NVLINK_GBPS,
    PEAK_BF16_TFLOPS,
    TRAINING_MFU,
    Range,
    active_gemm_params,
    estimate_sync,
    estimate_throughput,
    forward_flops_per_token,
    gathered_bytes_per_gpu,
    sync_refusal,
)
from megatron_rl.plan.param_count import engine_gpu_weights, hf_tensor_counts, model_params, synced_model_bytes
from megatron_rl.plan.report import estimates_section
from tests.unit.test_memory_plan import ARCH_30B, RECIPE, TINY_MOE


def test_range_division_pairs_the_opposite_ends():
    assert Range(10, 20).per(Range(2, 5)) == Range(2, 10)
    assert Range(1, 2) + Range(3, 5) == Range(4, 7)
    with pytest.raises(ValueError, match="low"):
        Range(2, 1)


def test_active_gemm_params_by_hand():
    # per layer: qkv (4 + 2*2) heads x 16 x 32 + proj 32 x 4*16 = 6144; MoE layers 0, 2, 3: top-2 experts
    # x 3 x 16 x 32 + router 4 x 32 = 3200; dense layer 1: 3 x 48 x 32 = 4608; output layer 100 x 32
    assert active_gemm_params(TINY_MOE) == 4 * 6144 + 3 * 3200 + 4608 + 3200
    assert forward_flops_per_token(TINY_MOE, context=10) == 2 * 41984 + 4 * 4 * 4 * 16 * 10
    # Qwen3-30B-A3B: 48 x (18,874,368 attention + 38,010,880 MoE) + 151,936 x 2,048 output layer
    assert active_gemm_params(ARCH_30B) == 48 * (18_874_368 + 38_010_880) + 151_936 * 2_048


def test_tensor_counts_are_the_checkpoints():
    """Qwen3-30B-A3B: 48 layers x (4 projections, 2 QK norms, 2 layer norms, router) + embedding, final norm,
    output layer; 48 x 128 x 3 expert tensors. The tiny model: layer 1 dense (3 MLP tensors, no router)."""
    assert hf_tensor_counts(ARCH_30B) == (48 * 9 + 3, 48 * 128 * 3) == (435, 18_432)
    assert hf_tensor_counts(TINY_MOE) == (3 * 9 + 11 + 3, 3 * 4 * 3)


def _recipe(*overrides: str):
    return load_recipe(RECIPE, list(overrides), require_files=False)[0]


def _with_transport(cfg, transport: str):
    """``cfg`` with ``weight_sync.transport`` set past validation (multi-node tensor was refused before issue 25)."""
    return cfg.model_copy(update={"weight_sync": cfg.weight_sync.model_copy(update={"transport": transport})})


def test_sync_seconds_are_bytes_over_the_assumed_link():
    model_bytes = model_params(ARCH_30B).total * 2
    cfg = _with_transport(_recipe(), "disk")
    disk = estimate_sync(cfg, ARCH_30B)
    assert disk.transport == "disk" and disk.model_bytes == disk.link_bytes == model_bytes
    write, read = FS_WRITE_GBPS.value, FS_READ_GBPS.value
    assert disk.seconds.low == pytest.approx(model_bytes / (write.high * 1e9) + model_bytes / (read.high * 1e9))
    assert disk.seconds.high == pytest.approx(model_bytes / (write.low * 1e9) + model_bytes / (read.low * 1e9))
    distributed = estimate_sync(cfg, ARCH_30B, "distributed")
    assert distributed.seconds.low == pytest.approx(model_bytes / (NETWORK_GBPS.value.high * 1e9))
    with pytest.raises(ValueError, match="unknown weight-sync transport"):
        estimate_sync(cfg, ARCH_30B, "carrier-pigeon")


def test_gathered_bytes_are_the_shards_a_gpu_lacks():
    """At TP 4 x EP 8 ETP 1 a GPU holds a quarter of the dense and an eighth of the expert parameters."""
    params = model_params(ARCH_30B)
    assert params.expert == 48 * 128 * 3 * 768 * 2048
    gathered = gathered_bytes_per_gpu(ARCH_30B, _recipe().parallel)
    assert gathered == params.dense * 2 * 3 // 4 + params.expert * 2 * 7 // 8
    assert round(gathered / 1e9, 2) == 53.05
    assert gathered_bytes_per_gpu(ARCH_30B, ParallelConfig(tp=1, ep=1)) == 0  # one GPU holds it all already
    assert gathered_bytes_per_gpu(ARCH_30B, ParallelConfig(tp=2, ep=2, etp=2)) == (
        params.dense * 2 // 2 + params.expert * 2 * 3 // 4
    )


def test_tensor_sync_is_per_gpu_gathers_the_engines_share_and_every_tensor():
    cfg = _with_transport(_recipe(), "tensor")
    tensor = estimate_sync(cfg, ARCH_30B)
    gathered = gathered_bytes_per_gpu(ARCH_30B, cfg.parallel)
    weights = engine_gpu_weights(ARCH_30B, cfg.rollout)
    share = (weights.gemm + weights.other) * 2
    assert tensor.link_bytes == gathered + share
    nvlink, export, load = NVLINK_GBPS.value, EXPORT_MICROSECONDS_PER_TENSOR.value, LOAD_MICROSECONDS_PER_TENSOR.value
    gathers, copy, exported, loaded = (term.seconds for term in tensor.terms)
    assert gathers.low == pytest.approx(gathered / (nvlink.high * 1e9))
    assert copy.high == pytest.approx(share / (nvlink.low * 1e9))
    # every trainer rank exports all 435 dense + 18,432 expert tensors; an engine rank at EP 4 loads the dense
    # ones and a quarter of the experts, at both ends of the ranges
    assert (exported.low, exported.high) == pytest.approx((18_867 * export.low * 1e-6, 18_867 * export.high * 1e-6))
    assert (loaded.low, loaded.high) == pytest.approx((5_043 * load.low * 1e-6, 5_043 * load.high * 1e-6))
    assert tensor.seconds.low == pytest.approx(gathers.low + copy.low + exported.low + loaded.low)
    assert tensor.seconds.high == pytest.approx(
        gathered / (nvlink.low * 1e9)
        + share / (nvlink.low * 1e9)
        + 18_867 * export.high * 1e-6
        + 5_043 * load.high * 1e-6
    )
    assert tensor.seconds.high <= 1.5  # issue 25's bound for the 30B recipe
    engine_ep_1 = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"ep": 1})})
    assert estimate_sync(engine_ep_1, ARCH_30B).terms[-1].label == "18,867 tensors loaded"
    # every node syncs its own engines at once: one node is no faster than four
    one_node = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"nodes": 1})})
    assert estimate_sync(one_node, ARCH_30B).seconds == tensor.seconds


def test_tensor_sync_across_nodes_needs_pipeline_parallel_one():
    cfg = _with_transport(_recipe("parallel.pp=2", "weight_sync.transport=disk"), "tensor")
    assert sync_refusal(_recipe(), "tensor") is None and sync_refusal(cfg, "disk") is None
    assert "parallel.pp 1, not 2" in (sync_refusal(cfg, "tensor") or "")
    with pytest.raises(ValueError, match="parallel.pp 1"):
        estimate_sync(cfg, ARCH_30B)
    assert estimates_section(cfg, ARCH_30B) == ["", f"estimated GPU figures: none ({sync_refusal(cfg, 'tensor')})"]
    disk = "\n".join(estimates_section(_recipe("parallel.pp=2", "weight_sync.transport=disk"), ARCH_30B))
    assert "other transports: distributed" in disk and "tensor" not in disk


def test_tensor_sync_on_one_node_broadcasts_the_other_stages():
    flat = _with_transport(_recipe("cluster.nodes=1"), "tensor")
    staged = _with_transport(_recipe("cluster.nodes=1", "parallel.pp=2", "parallel.ep=4"), "tensor")
    model_bytes = model_params(ARCH_30B).total * 2
    broadcast = {term.label: term.seconds for term in estimate_sync(staged, ARCH_30B).terms}[
        f"pipeline broadcast ({model_bytes // 2 / 1e9:.2f} GB)"
    ]
    assert broadcast.high == pytest.approx(model_bytes // 2 / (NVLINK_GBPS.value.low * 1e9))
    assert not any(term.label.startswith("pipeline") for term in estimate_sync(flat, ARCH_30B).terms)


def test_the_report_shows_the_tensor_terms():
    out = "\n".join(estimates_section(_with_transport(_recipe(), "tensor"), ARCH_30B))
    tensor = estimate_sync(_with_transport(_recipe(), "tensor"), ARCH_30B)
    low, high = tensor.seconds.low, tensor.seconds.high
    assert f"~ weight sync (tensor): {tensor.link_bytes / 1e9:.2f} GB per GPU at the NVLink rate" in out
    assert f"-> {low:,.2f}-{high:,.2f} s" in out
    assert (
        "= all-gathers (53.05 GB) " in out
        and " + 18,867 tensors exported " in out
        and " + 5,043 tensors loaded " in out
    )
    disk = "\n".join(estimates_section(_with_transport(_recipe(), "disk"), ARCH_30B))
    assert "(tensor: colocated engines, per GPU, every node at once)" in disk


def test_auto_transport_follows_the_placement_for_plan_and_syncer_alike():
    from megatron_rl.config.schema import WeightSyncConfig

    auto = WeightSyncConfig(transport="auto")
    assert auto.resolved("colocated") == "tensor" and auto.resolved("disaggregated") == "distributed"
    assert WeightSyncConfig(transport="disk").resolved("colocated") == "disk"
    disaggregated = _recipe("rollout.placement=disaggregated", "rollout.num_gpus=16", "weight_sync.transport=auto")
    assert estimate_sync(disaggregated, ARCH_30B).transport == "distributed"
    assert estimate_sync(_recipe(), ARCH_30B).transport == "tensor"


def test_throughput_of_the_30b_recipe_by_hand():
    cfg = _recipe()
    step = estimate_throughput(cfg, ARCH_30B)
    mean_sequence = (2048 + 20480) / 2
    assert step.tokens_per_step == 512 * 16 * mean_sequence
    assert step.training_forwards == 5  # old log-probs, forward + backward (3), full recompute; no KL
    flops = forward_flops_per_token(ARCH_30B, mean_sequence / 2)
    per_gpu, peak = step.tokens_per_step / 32, PEAK_BF16_TFLOPS * 1e12
    fastest = per_gpu * flops / (GENERATION_MFU.value.high * peak) + per_gpu * flops * 5 / (
        TRAINING_MFU.value.high * peak
    )
    assert step.step_seconds.low == pytest.approx(fastest + step.sync.seconds.low)
    assert step.tokens_per_second_per_gpu.high == pytest.approx(per_gpu / step.step_seconds.low)
    with_kl = estimate_throughput(_recipe("algorithm.preset=custom", "algorithm.use_kl_loss=true"), ARCH_30B)
    assert with_kl.training_forwards == 6 and with_kl.step_seconds.low > step.step_seconds.low


def test_plan_prints_the_estimates_with_their_assumptions(capsys):
    main(["plan", str(RECIPE)])
    out = capsys.readouterr().out
    assert "estimated GPU figures (~ modelled" in out
    assert "~ tokens/s/GPU: " in out
    quoted = (Path(__file__).parents[2] / "docs" / "performance.md").read_text()
    lines = quoted[quoted.index("      ~ weight sync (tensor)") :].split("\n\n")[0].splitlines()
    assert len(lines) == 3 and all(line[4:] in out for line in lines)  # the lines docs/performance.md quotes
    for assumption in (GENERATION_MFU, TRAINING_MFU, FS_WRITE_GBPS, FS_READ_GBPS, NVLINK_GBPS, NETWORK_GBPS):
        assert assumption.line() in out


def test_disaggregated_step_generates_on_the_engine_gpus_and_trains_on_the_rest():
    cfg = _recipe("rollout.placement=disaggregated", "rollout.num_gpus=16", "weight_sync.transport=auto")
    step = estimate_throughput(cfg, ARCH_30B)
    assert step.sync.transport == "distributed"
    flops = forward_flops_per_token(ARCH_30B, step.mean_sequence / 2)
    peak = PEAK_BF16_TFLOPS * 1e12
    generation = step.tokens_per_step / 16 * flops / (GENERATION_MFU.value.high * peak)
    training = step.tokens_per_step / 16 * flops * 5 / (TRAINING_MFU.value.high * peak)
    assert step.step_seconds.low == pytest.approx(generation + training + step.sync.seconds.low)
    assert step.tokens_per_second_per_gpu.high == pytest.approx(step.tokens_per_step / 32 / step.step_seconds.low)


def test_an_async_step_is_the_longer_of_generation_and_training_plus_the_sync():
    overrides = ("rollout.placement=disaggregated", "rollout.num_gpus=16", "weight_sync.transport=auto")
    synchronous = estimate_throughput(_recipe(*overrides), ARCH_30B)
    pipelined = estimate_throughput(_recipe(*overrides, "train.max_staleness=1"), ARCH_30B)
    flops = forward_flops_per_token(ARCH_30B, pipelined.mean_sequence / 2)
    peak = PEAK_BF16_TFLOPS * 1e12
    generation = pipelined.tokens_per_step / 16 * flops / (GENERATION_MFU.value.high * peak)
    training = pipelined.tokens_per_step / 16 * flops * 5 / (TRAINING_MFU.value.high * peak)
    assert pipelined.step_seconds.low == pytest.approx(max(generation, training) + pipelined.sync.seconds.low)
    assert pipelined.step_seconds.high < synchronous.step_seconds.high
    assert Range(1, 5).longer(Range(2, 3)) == Range(2, 5)


def test_an_fp8_sync_sends_each_projection_in_one_byte_with_its_block_scales():
    """Qwen3-30B-A3B: everything but the embedding, output layer, norms and routers is quantised; every
    projection's sides divide 128, so the scales are 4 B per 128 x 128 elements."""
    params = model_params(ARCH_30B).total
    kept = 2 * 151_936 * 2_048 + 2_048 + 48 * (2 * 2_048 + 2 * 128 + 128 * 2_048)
    quantized = params - kept
    assert synced_model_bytes(ARCH_30B, None) == 2 * params
    assert synced_model_bytes(ARCH_30B, (128, 128)) == 2 * kept + quantized + quantized // (128 * 128) * 4
    bf16 = estimate_sync(_with_transport(_recipe(), "tensor"), ARCH_30B)
    fp8 = estimate_sync(_with_transport(_recipe("rollout.quantization=fp8"), "tensor"), ARCH_30B)
    weights = engine_gpu_weights(ARCH_30B, _recipe().rollout)
    assert fp8.link_bytes == bf16.link_bytes - weights.gemm  # the engine copies its GEMM weights in one byte
    # an engine rank at EP 4 loads 435 + 4,608 tensors and a scales tensor for 192 projections and 4,608 experts
    assert fp8.terms[-1].label == f"{435 + 4_608 + 4 * 48 + 4_608:,} tensors loaded"


def test_plan_prints_the_fp8_recipes_engines_and_sync(capsys):
    main(["plan", str(RECIPE.with_name("qwen3_30b_a3b_dapo_fp8.yaml"))])
    out = capsys.readouterr().out
    cfg = _recipe("rollout.quantization=fp8", "train.precision=fp8", "train.fp8_recipe=blockwise")
    sync = estimate_sync(cfg, ARCH_30B)
    assert "fp8, recompute full" in out and "colocated, fp8 GEMM weights" in out
    assert f"~ weight sync (tensor): {sync.link_bytes / 1e9:.2f} GB per GPU" in out
    assert sync.seconds.high <= 1.5
