"""What SGLang 0.5.23 can serve of a recipe's ``lora:`` section, and what RL needs of it.

Each rule cites the SGLang source it follows (paths under ``sglang/srt/`` of the 0.5.23 wheel):

- ``lora/utils.py`` ``get_normalized_target_modules``: ``q_proj``, ``k_proj``, ``v_proj`` become one
  ``qkv_proj`` target and ``gate_proj``, ``up_proj`` one ``gate_up_proj``.
- ``lora/lora.py`` ``normalize_qkv_proj``: the stacked q/k/v adapter is built from every ``q_proj`` weight
  with its ``v_proj`` partner read unconditionally (``k_proj`` may be missing: zeros), so an adapter on
  k or v needs q_proj and v_proj.
- ``lora/lora.py`` ``normalize_gate_up_proj``: the stacked gate/up adapter is built from ``gate_proj``
  (a missing ``up_proj`` becomes zeros); an ``up_proj`` without ``gate_proj`` is kept as is and
  matches no buffer of a gated (SwiGLU) MLP.
- ``lora/lora_manager.py`` ``init_lora_modules``: a layer's ``FusedMoE`` (all routed experts) gets a
  LoRA wrapper only when both ``gate_up_proj`` and ``down_proj`` are targets; otherwise its experts are
  served without the adapter.

- ``managers/tokenizer_control_mixin.py`` ``load_lora_adapter`` (and the tensor and unload variants): an
  adapter is loaded into a running engine only without data-parallel replicas (``dp_size == 1`` asserted),
  and a run loads each new adapter version so.
- ``lora/layers.py`` ``FusedMoEWithLoRA``: a MoE layer with LoRA runs its experts through the Triton MoE
  runner (``MoeRunnerBackend.TRITON``, ``fused_moe_lora``), which SGLang's CPU device does not have, so an
  engine on CPU serves LoRA on attention (and dense MLPs) only.
  (It serves those with ``--lora-backend torch_native`` and host-memory pinning made a no-op:
  ``docs/sglang-lora-cpu.md``.)

Not refused, because SGLang 0.5.23 serves it: FP8 rollouts with LoRA (``lora/layers.py``
``FusedMoEWithLoRA`` runs on the base layer's quant method, ``Fp8MoEMethod.get_triton_quant_info``, and
the linear LoRA wrappers call ``base_layer.quant_method.apply``); engine EP (``lora/mem_pool.py`` keeps
the local experts' slots). The rank cannot exceed the engines' ``--max-lora-rank``: the run starts them
with ``lora.rank``. The target rules hold for the reference engine too: it serves what SGLang serves, routed
experts included (``engines/reference/lora_adapters.py``), and runs LoRA on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config.hf_config import QwenArchitecture
from megatron_rl.config.schema import LoRAConfig

Problem = tuple[str, str]
"""(dotted field, message with the fix)."""


@dataclass(frozen=True)
class SGLangEngineShape:
    """What the LoRA rules need of SGLang rollout engines: data-parallel replicas per engine, and whether they run
    on CPU."""

    dp: int
    on_cpu: bool


def _attention_problems(targets: set[str], listed: list[str]) -> list[Problem]:
    qkv = targets & {"q_proj", "k_proj", "v_proj"}
    if not qkv or {"q_proj", "v_proj"} <= qkv:
        return []
    missing = sorted({"q_proj", "v_proj"} - qkv)
    return [
        (
            "lora.target_modules",
            f"{listed} adapts {', '.join(sorted(qkv))} without {', '.join(missing)}: SGLang 0.5.23 stacks q/k/v into "
            "one qkv_proj adapter built from q_proj's and v_proj's weights (k_proj may be left out), so add "
            f"{', '.join(missing)} or drop {', '.join(sorted(qkv))}",
        )
    ]


def _mlp_problems(targets: set[str], listed: list[str], arch: QwenArchitecture) -> list[Problem]:
    mlp = targets & {"gate_proj", "up_proj", "down_proj"}
    if "up_proj" in mlp and "gate_proj" not in mlp:
        return [
            (
                "lora.target_modules",
                f"{listed} adapts up_proj without gate_proj: SGLang 0.5.23 stacks gate/up into one gate_up_proj "
                "adapter built from gate_proj's weights (up_proj may be left out), so add gate_proj",
            )
        ]
    if arch.is_moe and mlp and not {"gate_proj", "down_proj"} <= mlp:
        missing = sorted({"gate_proj", "down_proj"} - mlp)
        return [
            (
                "lora.target_modules",
                f"{listed} adapts {', '.join(sorted(mlp))} of the routed experts without {', '.join(missing)}: "
                "SGLang 0.5.23 puts LoRA on a MoE layer's experts only when both gate_up_proj and down_proj are "
                "targets, and would serve these experts without their adapter; add "
                f"{', '.join(missing)} or drop {', '.join(sorted(mlp))}",
            )
        ]
    return []


def _sglang_engine_problems(lora: LoRAConfig, arch: QwenArchitecture, engine: SGLangEngineShape) -> list[Problem]:
    problems: list[Problem] = []
    if engine.dp > 1:
        problems.append(
            (
                "rollout.dp",
                f"{engine.dp}: SGLang 0.5.23 loads a LoRA adapter into a running engine only without data-parallel "
                "replicas (managers/tokenizer_control_mixin.py asserts dp_size == 1), and each sync loads a new "
                "one; set rollout.dp=1 and rollout.num_engines to the replicas you want",
            )
        )
    experts = sorted(set(lora.target_modules) & {"gate_proj", "up_proj", "down_proj"})
    if engine.on_cpu and arch.is_moe and experts:
        problems.append(
            (
                "lora.target_modules",
                f"{experts} on the routed experts: SGLang 0.5.23 runs MoE LoRA through its Triton MoE runner "
                "(lora/layers.py FusedMoEWithLoRA), which its CPU device lacks; on CPU adapt attention only "
                "(q_proj, k_proj, v_proj, o_proj) or use rollout.engine=reference",
            )
        )
    return problems


def lora_errors(lora: LoRAConfig, arch: QwenArchitecture, sglang: SGLangEngineShape | None) -> list[Problem]:
    """What stops a recipe with ``lora``: RL's need of a deterministic adapter and what SGLang 0.5.23 cannot
    serve (module docstring); ``sglang``: the rollout engines' shape when they are SGLang (None: reference)."""
    problems: list[Problem] = []
    if lora.dropout > 0:
        problems.append(
            (
                "lora.dropout",
                f"{lora.dropout:g}: the engines sample without dropout, so the trainer's log-probs (old log-probs, "
                "importance ratios) would be of a different, noisy policy; set lora.dropout=0",
            )
        )
    targets: set[str] = set(lora.target_modules)
    listed: list[str] = list(lora.target_modules)
    problems += _attention_problems(targets, listed) + _mlp_problems(targets, listed, arch)
    return problems + (_sglang_engine_problems(lora, arch, sglang) if sglang is not None else [])


def lora_warnings(lora: LoRAConfig, arch: QwenArchitecture) -> list[Problem]:
    """Settings that do nothing on this model."""
    if lora.experts_shared_outer and not (arch.is_moe and {"gate_proj", "down_proj"} <= set(lora.target_modules)):
        return [
            (
                "lora.experts_shared_outer",
                "shares the experts' outer matrices, but no routed expert has an adapter (a dense model, or no "
                "gate_proj/down_proj target): it does nothing",
            )
        ]
    return []
