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

Not refused, because SGLang 0.5.23 serves it: FP8 rollouts with LoRA (``lora/layers.py``
``FusedMoEWithLoRA`` runs on the base layer's quant method, ``Fp8MoEMethod.get_triton_quant_info``, and
the linear LoRA wrappers call ``base_layer.quant_method.apply``); engine EP (``lora/mem_pool.py`` keeps
the local experts' slots); ``--dp-size`` replicas (the DP-attention limits of ``lora_manager.py`` do not
apply: the engines do not enable DP attention). The rank cannot exceed the engines' ``--max-lora-rank``:
the run starts them with ``lora.rank``.
"""

from __future__ import annotations

from megatron_rl.config.hf_config import QwenArchitecture
from megatron_rl.config.schema import LoRAConfig

Problem = tuple[str, str]
"""(dotted field, message with the fix)."""


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


def lora_errors(lora: LoRAConfig, arch: QwenArchitecture) -> list[Problem]:
    """What stops a recipe with ``lora``: RL's need of a deterministic adapter and what SGLang 0.5.23 cannot
    serve (module docstring)."""
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
    return problems + _attention_problems(targets, listed) + _mlp_problems(targets, listed, arch)


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
