"""The ``lora:`` recipe section (issue 40, first slice): its schema, what ``validate`` refuses of it (what
SGLang 0.5.23 cannot serve, and dropout), the adapter counts ``plan`` makes by hand, and ``train``'s refusal."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from megatron_rl.cli import main
from megatron_rl.config import RecipeError, load_recipe
from megatron_rl.config.hf_config import parse_hf_config
from megatron_rl.config.model_source import read_architecture
from megatron_rl.config.schema import LoRAConfig, ParallelConfig, RolloutConfig, RunConfig
from megatron_rl.orchestration.driver import refuse_unbuilt
from megatron_rl.plan.estimates import estimate_sync
from megatron_rl.plan.lora_count import (
    adapter_tensor_counts,
    engine_adapter,
    engine_slot,
    largest_adapter_tensor,
    layer_adapter,
    stage_adapter,
    whole_adapter,
)
from megatron_rl.plan.memory import plan_memory, state_amounts
from megatron_rl.plan.param_count import ParamCount, stage_params
from tests.hf_configs import QWEN3_30B_A3B, QWEN3_30B_A3B_CONFIG_FILE
from tests.unit.test_memory_plan import TINY_MOE

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
TINY = RECIPES / "tiny_moe_cpu_dapo.yaml"
QWEN_30B = RECIPES / "qwen3_30b_a3b_dapo.yaml"
ONE_NODE = (f"model.config_fallback={QWEN3_30B_A3B_CONFIG_FILE}", "cluster.nodes=1")
DENSE = ("model.random_init.architectures=[Qwen3ForCausalLM]", "parallel.ep=1")
ARCH_30B = parse_hf_config(QWEN3_30B_A3B)


def _load(recipe: Path, *overrides: str) -> tuple[RunConfig, list[str]]:
    cfg, findings = load_recipe(recipe, list(overrides), require_files=False)
    return cfg, [str(f) for f in findings]


def _problems(*overrides: str, recipe: Path = TINY) -> list[str]:
    with pytest.raises(RecipeError) as info:
        load_recipe(recipe, list(overrides), require_files=False)
    return info.value.problems


@pytest.mark.parametrize(
    "recipe", sorted(p for p in RECIPES.glob("*.yaml") if not p.stem.endswith("_lora")), ids=lambda p: p.name
)
def test_recipes_without_lora_train_every_parameter_as_before(recipe: Path) -> None:
    cfg, _ = _load(recipe, *([f"model.config_fallback={QWEN3_30B_A3B_CONFIG_FILE}"] if "qwen3" in recipe.name else []))
    assert cfg.lora is None
    arch = read_architecture(cfg.model.path, cfg.model.random_init, cfg.model.config_fallback)
    stage = plan_memory(cfg, arch, 80.0).stages[0]
    assert stage.adapter is None and stage.parameter_bytes == stage.state[0].nbytes
    assert not any("LoRA" in a.label or "frozen" in a.label for a in stage.state)


def test_the_section_s_defaults_and_ranges() -> None:
    lora = LoRAConfig(rank=8)
    assert (lora.alpha, lora.dropout, lora.max_loras_per_batch, lora.experts_shared_outer) == (32.0, 0.0, 1, False)
    assert lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for bad in ({"rank": 0}, {"rank": 8, "alpha": 0.0}, {"rank": 8, "target_modules": ["lm_head"]}):
        with pytest.raises(ValidationError):
            LoRAConfig(**bad)
    with pytest.raises(ValidationError, match="names a module twice"):
        LoRAConfig(rank=8, target_modules=["q_proj", "q_proj"])
    with pytest.raises(ValidationError):
        LoRAConfig(rank=8, target_modules=[])


def test_dropout_is_refused_for_rl() -> None:
    assert any(
        p.startswith("lora.dropout: 0.05: the engines sample without dropout") and p.endswith("set lora.dropout=0")
        for p in _problems("lora.rank=4", "lora.dropout=0.05")
    )


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        ("[k_proj]", "adapts k_proj without q_proj, v_proj: SGLang 0.5.23 stacks q/k/v"),
        ("[q_proj, k_proj]", "adapts k_proj, q_proj without v_proj: SGLang 0.5.23 stacks q/k/v"),
        ("[up_proj, down_proj]", "adapts up_proj without gate_proj: SGLang 0.5.23 stacks gate/up"),
        ("[gate_proj, up_proj]", "adapts gate_proj, up_proj of the routed experts without down_proj: SGLang 0.5.23 "),
        ("[down_proj]", "adapts down_proj of the routed experts without gate_proj: SGLang 0.5.23 puts LoRA"),
    ],
)
def test_targets_sglang_cannot_serve_are_refused_with_the_fix(targets: str, message: str) -> None:
    problems = _problems("lora.rank=4", f"lora.target_modules={targets}")
    assert any(p.startswith("lora.target_modules: [") and message in p and "add " in p for p in problems), problems


@pytest.mark.parametrize(
    "targets", ["[q_proj, v_proj]", "[q_proj, k_proj, v_proj, o_proj]", "[o_proj]", "[gate_proj, down_proj]"]
)
def test_targets_sglang_serves_validate(targets: str) -> None:
    cfg, _ = _load(TINY, "lora.rank=4", f"lora.target_modules={targets}")
    assert cfg.lora is not None and cfg.rollout.engine == "reference"  # it serves them, experts included


def test_a_dense_model_may_adapt_down_proj_alone_and_shared_outer_warns() -> None:
    cfg, warnings = _load(TINY, *DENSE, "lora.rank=4", "lora.target_modules=[down_proj]")
    assert cfg.lora is not None and not [w for w in warnings if w.startswith("lora")]
    _, warnings = _load(TINY, *DENSE, "lora.rank=4", "lora.experts_shared_outer=true")
    assert any(w.startswith("lora.experts_shared_outer: shares the experts' outer matrices") for w in warnings)


def test_sglang_engines_refuse_replicas_and_expert_adapters_on_cpu() -> None:
    """SGLang 0.5.23 loads adapters into running engines only without DP replicas, and runs MoE LoRA through its
    Triton runner, which its CPU device lacks (config/lora_checks.py cites both)."""
    problems = _problems(*ONE_NODE, "lora.rank=32", "rollout.dp=2", recipe=QWEN_30B)
    assert any(p.startswith("rollout.dp: 2: SGLang 0.5.23 loads a LoRA adapter") for p in problems), problems
    sglang_cpu = RECIPES / "tiny_moe_cpu_dapo_sglang.yaml"
    problems = _problems("lora.rank=4", recipe=sglang_cpu)
    assert any(
        p.startswith("lora.target_modules: ['down_proj', 'gate_proj', 'up_proj'] on the routed experts")
        and p.endswith("or use rollout.engine=reference")
        for p in problems
    ), problems
    cfg, _ = _load(sglang_cpu, "lora.rank=4", "lora.target_modules=[q_proj, k_proj, v_proj, o_proj]")
    assert cfg.lora is not None and cfg.rollout.engine == "sglang"


def test_fp8_rollouts_with_lora_validate_and_sync_the_bf16_adapter() -> None:
    """SGLang 0.5.23 runs MoE LoRA on the FP8 base's quant method (lora/layers.py FusedMoEWithLoRA); the adapter
    itself is sent in bf16, unquantised."""
    cfg, _ = _load(QWEN_30B, *ONE_NODE, "lora.rank=32", "rollout.quantization=fp8")
    assert estimate_sync(cfg, ARCH_30B).model_bytes == whole_adapter(ARCH_30B, LoRAConfig(rank=32)).total * 2


def test_train_refuses_what_lora_does_not_build_yet_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(ValueError, match=r"LoRA training on GPUs is not built yet \(issue 40"):
        refuse_unbuilt(_load(QWEN_30B, *ONE_NODE, "lora.rank=32")[0])
    shared = ("lora.rank=4", "lora.experts_shared_outer=true")
    assert main(["validate", str(TINY), *shared]) == 0
    capsys.readouterr()
    assert main(["train", str(TINY), *shared]) == 1
    assert "lora.experts_shared_outer: true is not built yet" in capsys.readouterr().err
    refuse_unbuilt(_load(TINY, "lora.rank=4")[0])  # the CPU trainer builds it


def test_adapter_counts_of_the_tiny_model_by_hand() -> None:
    """TINY_MOE: h 32, 4 heads / 2 KV heads of 16, layers 0, 2, 3 MoE (4 experts of f_e 16), layer 1 dense (f 48).
    Per layer and rank r: q and o r (h + 4 x 16), k and v r (h + 2 x 16); per expert 3 r (h + f_e); dense MLP
    3 r (h + f)."""
    r = 4
    attention = 2 * r * (32 + 64) + 2 * r * (32 + 32)
    experts = 4 * 3 * r * (32 + 16)
    dense_mlp = 3 * r * (32 + 48)
    lora = LoRAConfig(rank=r)
    assert whole_adapter(TINY_MOE, lora) == ParamCount(dense=4 * attention + dense_mlp, expert=3 * experts)
    # shared outer: per MoE layer one gate A, one up A (r h each) and one down B (h r), per expert gate B, up B and
    # down A (r f_e each)
    shared = whole_adapter(TINY_MOE, LoRAConfig(rank=r, experts_shared_outer=True))
    assert shared == ParamCount(dense=4 * attention + dense_mlp + 3 * 3 * r * 32, expert=3 * 4 * 3 * r * 16)
    # tp 2 x ep 2, etp 1: column-parallel B and row-parallel A halve, experts 2 a rank whole
    sharded = layer_adapter(TINY_MOE, 0, lora, ParallelConfig(tp=2, ep=2, etp=1))
    q_o = (r * 32 + 64 // 2 * r) + (r * 64 // 2 + 32 * r)  # q: A whole, B halved; o: A halved, B whole
    k_v = 2 * (r * 32 + 16 * r)  # one KV head of 16 a rank
    assert sharded == ParamCount(dense=q_o + k_v, expert=2 * 3 * r * (32 + 16))
    assert adapter_tensor_counts(TINY_MOE, lora) == (4 * 8 + 6, 3 * 4 * 6)


def test_adapter_counts_of_the_tiny_recipe_s_model_by_hand() -> None:
    """tiny_moe_cpu's model: h 64, 4 heads / 2 KV heads of 16, 2 MoE layers of 4 experts (f_e 64); rank 4:
    per layer q, o 4 (64 + 64), k, v 4 (64 + 32), experts 4 x 3 x 4 (64 + 64)."""
    cfg, _ = _load(TINY, "lora.rank=4")
    arch = read_architecture(None, cfg.model.random_init)
    assert cfg.lora is not None
    per_layer = 2 * 4 * 128 + 2 * 4 * 96 + 4 * 3 * 4 * 128
    assert whole_adapter(arch, cfg.lora).total == 2 * per_layer == 15_872
    # ep 2: each rank holds 2 experts' adapters and all attention adapters
    assert stage_adapter(arch, cfg.lora, cfg.parallel, 0) == ParamCount(dense=2 * 1792, expert=2 * 2 * 3 * 4 * 128)


def test_adapter_counts_of_qwen3_30b_a3b_by_hand() -> None:
    """Qwen3-30B-A3B: h 2048, 32 heads / 4 KV heads of 128, 48 MoE layers of 128 experts (f_e 768).

    whole = 48 x [2 r (2048 + 4096) + 2 r (2048 + 512) + 128 x 3 r (2048 + 768)]; at r 32: 557,056 attention
    + 34,603,008 expert elements a layer. Per trainer GPU at the recipe's tp 4 x ep 8 (etp 1): q, o
    r 2048 + r 1024 each, k, v r 2048 + r 128 each, 16 local experts whole.
    """
    r = 32
    lora = LoRAConfig(rank=r)
    assert whole_adapter(ARCH_30B, lora) == ParamCount(
        dense=48 * (2 * r * (2048 + 4096) + 2 * r * (2048 + 512)), expert=48 * 128 * 3 * r * (2048 + 768)
    )
    assert whole_adapter(ARCH_30B, lora).total == 1_687_683_072
    per_gpu = stage_adapter(ARCH_30B, lora, ParallelConfig(tp=4, ep=8, etp=1), 0)
    assert per_gpu == ParamCount(
        dense=48 * (2 * (r * 2048 + r * 1024) + 2 * (r * 2048 + r * 128)), expert=48 * 16 * 3 * r * (2048 + 768)
    )
    assert per_gpu.total == 223_739_904
    shared = whole_adapter(ARCH_30B, LoRAConfig(rank=r, experts_shared_outer=True))
    assert shared.total == 48 * (557_056 + 3 * r * 2048 + 128 * 3 * r * 768) == 489_160_704
    # the largest tensor a sync sends: q_proj's B or o_proj's A (4096 x r); shared outer, a 3-D per-expert part
    assert largest_adapter_tensor(ARCH_30B, lora) == 4096 * r
    assert largest_adapter_tensor(ARCH_30B, LoRAConfig(rank=r, experts_shared_outer=True)) == 128 * 768 * r


def test_the_30b_lora_recipe_fits_one_node_and_prints_its_sync(capsys: pytest.CaptureFixture[str]) -> None:
    recipe = RECIPES / "qwen3_30b_a3b_dapo_lora.yaml"
    cfg, _ = _load(recipe, f"model.config_fallback={QWEN3_30B_A3B_CONFIG_FILE}")
    assert cfg.lora is not None and (cfg.cluster.nodes, cfg.cluster.gpus_per_node) == (1, 8)
    plan = plan_memory(cfg, ARCH_30B, 80.0)
    assert not plan.problems and f"{plan.stages[0].total / 2**30:.1f}" == "39.0"  # README's figure
    assert main(["plan", str(recipe), f"model.config_fallback={QWEN3_30B_A3B_CONFIG_FILE}"]) == 0
    out = capsys.readouterr().out
    assert "each weight sync sends the adapter alone: 3,375.4 MB" in out
    assert "~ weight sync of the LoRA adapter (tensor): 3.79 GB per GPU" in out and "FITS" in out


def test_engine_slots_stack_q_k_v_and_gate_up_as_sglang_does() -> None:
    rollout = RolloutConfig(tp=4, ep=4)
    q_v = LoRAConfig(rank=8, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
    assert engine_slot(ARCH_30B, q_v, rollout) == engine_slot(ARCH_30B, LoRAConfig(rank=8), rollout)
    assert engine_adapter(ARCH_30B, q_v, rollout).total < engine_slot(ARCH_30B, q_v, rollout).total


def test_plan_of_the_30b_recipe_with_lora_on_one_node(capsys: pytest.CaptureFixture[str]) -> None:
    full, _ = _load(QWEN_30B, *ONE_NODE)
    lora, _ = _load(QWEN_30B, *ONE_NODE, "lora.rank=32")
    full_stage = plan_memory(full, ARCH_30B, 80.0).stages[0]
    lora_plan = plan_memory(lora, ARCH_30B, 80.0)
    stage = lora_plan.stages[0]
    # the engines' base and LoRA pool stay on the GPU through training (the LoRA engines serve the base)
    kept = lora_plan.engine.weight_bytes + lora_plan.engine.lora_pool_bytes if lora_plan.engine else 0
    assert any(a.label.startswith("engine weights + LoRA pool") and a.nbytes == kept > 0 for a in stage.working)
    assert stage.total - kept < 0.4 * full_stage.total and not lora_plan.problems
    # README's figures: the trainer's GiB per GPU with and without lora:
    assert (f"{stage.total / 2**30:.1f}", f"{full_stage.total / 2**30:.1f}") == ("39.0", "78.0")
    base = stage_params(ARCH_30B, lora.parallel, 0)
    adapter = stage_adapter(ARCH_30B, LoRAConfig(rank=32), lora.parallel, 0)
    # the frozen base: its bf16 parameters only; the adapter: what a full run's parameters would cost
    assert stage.state[0].nbytes == base.total * 2
    assert [a.nbytes for a in stage.state[1:]] == [a.nbytes for a in state_amounts(adapter, lora.train, 2, 1)]
    assert main(["plan", str(QWEN_30B), *ONE_NODE, "lora.rank=32"]) == 0
    out = capsys.readouterr().out
    assert "each weight sync sends the adapter alone: 3,375.4 MB (3,375,366,144 bytes, bf16)" in out
    assert "~ weight sync of the LoRA adapter (tensor):" in out and "FITS" in out
