"""`megatron-rl plan`: byte arithmetic with hand-computed numbers, KV cache, the 30B recipe's report and exit codes."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.cli import main
from megatron_rl.config import load_recipe
from megatron_rl.config.hf_config import parse_hf_config
from megatron_rl.config.schema import ParallelConfig, RolloutConfig, TrainConfig
from megatron_rl.plan.memory import (
    GIB,
    activation_bytes,
    engine_plan,
    largest_gathered_bytes,
    layer_activation_elements,
    logprob_bytes,
    micro_batches_in_flight,
    optimizer_state_bytes,
    plan_memory,
    state_amounts,
    sync_staging,
)
from megatron_rl.plan.param_count import ParamCount, engine_gpu_weights, model_params, stage_params
from tests.hf_configs import QWEN3_30B_A3B, QWEN3_235B_A22B_CONFIG_FILE

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "qwen3_30b_a3b_dapo.yaml"
ARCH_30B = parse_hf_config(QWEN3_30B_A3B)
TINY_MOE = parse_hf_config(
    {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "mlp_only_layers": [1],
        "rope_theta": 10000.0,
        "max_position_embeddings": 64,
    }
)


def _train(**fields) -> TrainConfig:
    return TrainConfig(steps=1, prompts_per_step=1, **fields)


def test_state_bytes_by_hand() -> None:
    params = ParamCount(dense=1001, expert=800)
    bf16 = [a.nbytes for a in state_amounts(params, _train(precision="bf16"), dp=4, expert_dp=2)]
    assert bf16 == [1801 * 2, 1801 * 4, (251 + 400) * 12]  # bf16 params, fp32 grads, fp32 main + m + v
    fp32 = [a.nbytes for a in state_amounts(params, _train(precision="fp32"), dp=4, expert_dp=2)]
    assert fp32 == [1801 * 4, 1801 * 4, (251 + 400) * 8]  # fp32 params are the main copy: m + v only
    assert optimizer_state_bytes(params, _train(precision="fp8", fp8_recipe="delayed"), 1, 1) == 1801 * 12


def test_30b_counts_per_rank_by_hand() -> None:
    counts = stage_params(ARCH_30B, ParallelConfig(tp=4, ep=8, etp=1, sequence_parallel=True), 0)
    vocab = 2 * 152064 // 4 * 2048  # padded to 128 x 4, split over TP, embedding + output layer
    layer = 5120 * 2048 // 4 + 2048 * 4096 // 4 + 2048 + 2 * 128 + 2048 + 128 * 2048  # qkv, proj, norms, router
    assert counts == ParamCount(dense=vocab + 48 * layer + 2048, expert=48 * 16 * 3 * 768 * 2048)
    assert model_params(ARCH_30B).expert == 48 * 128 * 3 * 768 * 2048
    assert round(model_params(ARCH_30B).total / 1e9, 2) == 30.53


def test_activation_elements_by_hand() -> None:
    attention = 3 * 32 + 3 * (4 + 2) * 16  # norm and QKV inputs; q/k-norm inputs, flash-attention q, k, v, out
    assert layer_activation_elements(TINY_MOE, 1, ParallelConfig()) == attention + 32 + 3 * 48
    moe = 2 * 32 + 2 * 4 + 2 * (2 * 32 + 3 * 16)  # router; 2 routed copies: expert in/out, SwiGLU
    assert layer_activation_elements(TINY_MOE, 0, ParallelConfig()) == attention + moe
    assert layer_activation_elements(TINY_MOE, 0, ParallelConfig(tp=2, etp=1)) == (attention + moe) / 2


def test_a_context_parallel_rank_holds_its_share_of_the_activations_and_logits() -> None:
    """Each CP rank holds T / cp tokens of every micro-batch: activations and logits divide by cp, state does not."""
    train = TrainConfig(steps=1, prompts_per_step=1, max_tokens_per_micro_batch=4096, logprob_chunk_tokens=0)
    single = ParallelConfig(tp=2, etp=1, sequence_parallel=True)
    split = ParallelConfig(tp=2, cp=4, etp=1, sequence_parallel=True)
    assert activation_bytes(TINY_MOE, split, train, 0) == activation_bytes(TINY_MOE, single, train, 0) / 4
    assert logprob_bytes(TINY_MOE, split, train) == logprob_bytes(TINY_MOE, single, train) / 4


def test_micro_batches_in_flight() -> None:
    assert [micro_batches_in_flight(ParallelConfig(pp=4), p) for p in range(4)] == [4, 3, 2, 1]
    assert micro_batches_in_flight(ParallelConfig(pp=2, vpp=2), 0) == (2 + 2 + 1) / 2  # 2(pp-1) + (vpp-1)pp + 1
    assert micro_batches_in_flight(ParallelConfig(pp=2, vpp=2), 0) == 2 * (1 + 1 / 4)  # Korthikanti's p(1 + (p-1)/pm)


@pytest.mark.parametrize("tp, heads_per_gpu", [(2, 2), (4, 1), (8, 1)])  # 4 KV heads; replicated beyond tp 4
def test_kv_cache_arithmetic(qwen3_30b_overrides: list[str], tp: int, heads_per_gpu: int) -> None:
    cfg = load_recipe(RECIPE, [*qwen3_30b_overrides, f"rollout.tp={tp}", "rollout.ep=2"], require_files=False)[0]
    engine = engine_plan(ARCH_30B, cfg, 80 * GIB)
    assert engine.kv_bytes_per_token == 2 * 48 * heads_per_gpu * 128 * 2
    assert engine.kv_pool_bytes == 0.7 * 80 * GIB - engine.weight_bytes
    assert engine.tokens_fit == int(engine.kv_pool_bytes // engine.kv_bytes_per_token)
    assert engine.tokens_needed == 512 // (32 // tp) * 16 * (2048 + 20480)


def test_engine_weights_30b_by_hand() -> None:
    weights = engine_gpu_weights(ARCH_30B, RolloutConfig(tp=4, ep=4))
    per_layer_gemm = 2 * 8 * 128 * 2048 + 2 * 1 * 128 * 2048 + 128 * 3 * 768 * 2048 // 4
    assert weights.gemm == 48 * per_layer_gemm
    assert weights.other == 48 * (2 * 2048 + 2 * 128 + 128 * 2048) + 2 * 151936 * 2048 // 4 + 2048
    assert weights.nbytes(None) == 2 * (weights.gemm + weights.other)
    assert weights.nbytes("fp8") == weights.gemm + 2 * weights.other


def test_plan_30b_recipe_fits_and_prints_totals(qwen3_30b_overrides: list[str], capsys) -> None:
    assert main(["plan", str(RECIPE), *qwen3_30b_overrides]) == 0
    out = capsys.readouterr().out
    for line in (
        "30.53B parameters",
        "4,018,878,464",  # largest rank: 394,999,808 dense + 3,623,878,656 expert
        "parameters (bf16)                                               7.49",
        "gradients (fp32 main grads)                                    14.97",
        "optimizer (Adam, /dp 8, experts /edp 4)                        10.68",
        "weights per GPU                      14.24 GiB",
        "KV bytes per token per GPU          24,576",
        "node 3: trainer ranks 24-31 on GPUs 0-7; engines 6 (GPUs 0-3), 7 (GPUs 4-7)",
        "FITS",
    ):
        assert line in out, line
    cfg = load_recipe(RECIPE, qwen3_30b_overrides, require_files=False)[0]
    total = plan_memory(cfg, ARCH_30B, 80.0).stages[0].total / GIB
    assert 40 < total < 50, total  # 33.1 GiB exact state + ~13 GiB estimated working memory
    unchunked = load_recipe(RECIPE, [*qwen3_30b_overrides, "train.logprob_chunk_tokens=0"], require_files=False)[0]
    saved = plan_memory(unchunked, ARCH_30B, 80.0).stages[0].total / GIB - total
    # The softmax workspace of 24,576 - 4,096 tokens x 38,016 columns (151,936 padded to 152,064, / TP 4) at 21.1 B;
    # a handful of float64 products and sums of the same terms: rounding ~1e-15 relative, on any CPU.
    assert saved == pytest.approx((24_576 - 4_096) * 38_016 * 21.1 / GIB, rel=1e-9)


def test_plan_names_the_knob_when_the_trainer_does_not_fit(qwen3_30b_overrides: list[str], capsys) -> None:
    assert main(["plan", str(RECIPE), *qwen3_30b_overrides, "parallel.ep=2"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "trainer stage 0: 106.7 GiB > 80 GiB GPU" in out
    assert "raise parallel.ep" in out


@pytest.mark.parametrize(
    "override, what, knob",
    [
        ("rollout.mem_fraction=0.15", "less than one 22528-token sequence", "raise rollout.mem_fraction"),
        ("rollout.mem_fraction=0.95", "rollout: 82.0 GiB > 80 GiB GPU", "lower rollout.mem_fraction"),
    ],
)
def test_plan_names_the_engine_knob(
    qwen3_30b_overrides: list[str], capsys, override: str, what: str, knob: str
) -> None:
    assert main(["plan", str(RECIPE), *qwen3_30b_overrides, override]) == 1
    out = capsys.readouterr().out
    assert what in out and knob in out


def test_plan_gpu_memory_option(qwen3_30b_overrides: list[str], capsys) -> None:
    assert main(["plan", str(RECIPE), *qwen3_30b_overrides, "--gpu-memory-gib", "40"]) == 1
    assert "> 40 GiB GPU" in capsys.readouterr().out


def test_reference_weights_are_counted_where_they_live(qwen3_30b_overrides: list[str]) -> None:
    kl = [*qwen3_30b_overrides, "algorithm.preset=custom", "algorithm.use_kl_loss=true", "algorithm.kl_coef=0.001"]
    host = plan_memory(load_recipe(RECIPE, kl, require_files=False)[0], ARCH_30B, 80.0)
    device_kl = [*kl, "algorithm.reference_placement=device"]
    device = plan_memory(load_recipe(RECIPE, device_kl, require_files=False)[0], ARCH_30B, 80.0)
    parameters = host.stages[0].parameter_bytes
    assert device.stages[0].total - host.stages[0].total == parameters
    # Colocated: the trainer state is offloaded to the host either way; the host copy of the reference is extra.
    assert host.host_bytes_per_node == device.host_bytes_per_node


def test_the_tensor_sync_holds_two_buffers_a_bucket_and_the_largest_tensor_twice_on_every_gpu(
    qwen3_30b_overrides: list[str],
) -> None:
    tensor_cfg = load_recipe(RECIPE, qwen3_30b_overrides, require_files=False)[0]
    assert tensor_cfg.weight_sync.transport == "tensor"  # the recipe's own
    disk_cfg = tensor_cfg.model_copy(
        update={"weight_sync": tensor_cfg.weight_sync.model_copy(update={"transport": "disk"})}
    )
    largest = 152_064 * 2048 * 2  # the vocabulary table padded to 128 x TP 4, bf16: 0.58 GiB > a bucket
    bucket = 512 * 2**20
    assert largest_gathered_bytes(ARCH_30B, tensor_cfg.parallel) == largest
    assert [a.nbytes for a in sync_staging(tensor_cfg, ARCH_30B)] == [4 * largest, bucket, 2 * largest]
    assert [a.nbytes for a in sync_staging(disk_cfg, ARCH_30B)] == [bucket + largest]
    tensor, disk = plan_memory(tensor_cfg, ARCH_30B, 80.0), plan_memory(disk_cfg, ARCH_30B, 80.0)
    peak = sum(a.nbytes for a in tensor.sync_peak)
    assert peak - sum(a.nbytes for a in disk.sync_peak) == 5 * largest  # buffers and one more largest tensor
    assert tensor.engine is not None
    parameters, engine = tensor.stages[0].parameter_bytes, tensor.engine.weight_bytes
    assert peak == parameters + engine + 4 * largest + bucket + 2 * largest + 2 * 3 * GIB  # + 2 process reserves
    assert not tensor.problems
    large = tensor_cfg.model_copy(
        update={"weight_sync": tensor_cfg.weight_sync.model_copy(update={"bucket_size_mb": 1024})}
    )
    assert sync_staging(large, ARCH_30B)[0].nbytes == 4 * 1024 * 2**20  # buffers follow the bucket when larger


def test_plan_235b_recipe_fits_on_16_nodes_and_names_only_the_kv_knobs_left(
    tmp_path: Path, qwen3_30b_overrides: list[str], capsys
) -> None:
    recipe = RECIPE.parent / "qwen3_235b_a22b_dapo.yaml"
    overrides = [f"model.path={tmp_path / 'Qwen3-235B-A22B'}", f"model.config_fallback={QWEN3_235B_A22B_CONFIG_FILE}"]
    assert main(["plan", str(recipe), *overrides]) == 0
    out = capsys.readouterr().out
    for line in (
        "235.09B parameters (dense 8.00B, expert 227.10B), 94 layers (94 MoE)",  # Qwen's card: 235B in total
        "trainer: 128 ranks = tp 4 x pp 1 x vpp 1 x cp 2 x dp 16; experts etp 1 x ep 64 x edp 2",
        "engines: 16 x sglang tp 8 ep 8 dp 1 (8 GPUs each), colocated, fp8 GEMM weights",
        "KV bytes per token per GPU          48,128 = 2 (K,V) x 94 layers x 1 KV head(s) x 128 x 2 B",
        "FITS",
    ):
        assert line in out, line
    # The engine already spans its node (tp 8) and serves FP8: only mem_fraction is left to raise.
    assert "SGLang queues the rest (slower, not an error); raise rollout.mem_fraction\n" in out
    # The 30B recipe (tp 4 engines, bf16) still gets all three knobs.
    assert main(["plan", str(RECIPE), *qwen3_30b_overrides]) == 0
    assert "raise rollout.mem_fraction or rollout.tp, or use rollout.quantization=fp8" in capsys.readouterr().out


def test_plan_235b_on_8_nodes_fits_with_the_uneven_pipeline_its_recipe_names(tmp_path: Path, capsys) -> None:
    """The recipe's 8-node alternative (NeMo-RL's 11 + 6 x 12 + 11 split over PP8) fits; no even split can at PP8."""
    recipe = RECIPE.parent / "qwen3_235b_a22b_dapo.yaml"
    overrides = [f"model.path={tmp_path / 'Qwen3-235B-A22B'}", f"model.config_fallback={QWEN3_235B_A22B_CONFIG_FILE}"]
    eight_nodes = ["cluster.nodes=8", "parallel.pp=8", "parallel.ep=8"]
    uneven = ["parallel.first_stage_layers=11", "parallel.last_stage_layers=11"]
    assert main(["plan", str(recipe), *overrides, *eight_nodes, *uneven]) == 0
    out = capsys.readouterr().out
    assert "0     0-10 " in out and "1     11-22 " in out and "7     83-93 " in out and "FITS" in out
    assert main(["plan", str(recipe), *overrides, *eight_nodes]) != 0
    assert "parallel.pp: pp (8) x vpp (1) = 8 does not divide the model's 94 layers" in capsys.readouterr().err


def test_plan_an_engine_spanning_two_nodes_per_gpu_and_per_node(tmp_path: Path, capsys) -> None:
    """TP16 x EP16 engines span two nodes: each GPU holds about half the weights of a TP8 engine's (KV heads and
    norms aside), the KV pool takes what they free, and each node lists the engine with its own GPUs."""
    recipe = RECIPE.parent / "qwen3_235b_a22b_dapo.yaml"
    overrides = [f"model.path={tmp_path / 'Qwen3-235B-A22B'}", f"model.config_fallback={QWEN3_235B_A22B_CONFIG_FILE}"]
    weights = {}
    for tp in (8, 16):
        assert main(["plan", str(recipe), *overrides, f"rollout.tp={tp}", f"rollout.ep={tp}"]) == 0
        out = capsys.readouterr().out
        weights[tp] = float(next(line for line in out.splitlines() if "weights per GPU" in line).split()[-2])
    assert 0.45 * weights[8] < weights[16] < 0.55 * weights[8]
    assert "engines: 8 x sglang tp 16 ep 16 dp 1 (16 GPUs each over 2 nodes, one SGLang process per node)" in out
    assert "  node 0: trainer ranks 0-7 on GPUs 0-7; engines 0 (GPUs 0-7 of the engine on nodes 0-1)" in out
    assert "  node 1: trainer ranks 8-15 on GPUs 0-7; engines 0 (GPUs 0-7 of the engine on nodes 0-1)" in out


def test_the_long_response_recipe_fits_only_with_context_parallelism(qwen3_30b_overrides: list[str], capsys) -> None:
    """README and the recipe: CP4 fits (60.2 GiB); without CP the trainer needs 114 GiB per GPU."""
    recipe = RECIPE.parent / "qwen3_30b_a3b_dapo_long.yaml"
    assert main(["plan", str(recipe), *qwen3_30b_overrides]) == 0
    out = capsys.readouterr().out
    assert "total of 80.00 GiB                                             60.20" in out and "FITS" in out
    assert main(["plan", str(recipe), *qwen3_30b_overrides, "parallel.cp=1"]) != 0
    assert "trainer stage 0: 114.2 GiB > 80 GiB GPU" in capsys.readouterr().out
