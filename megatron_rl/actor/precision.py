"""TransformerConfig fields the actor sets from the recipe: precision, FP8, recompute, MoE losses, replay.

Everything here is a plain dict of Megatron-core ``TransformerConfig`` field
names, applied as ``overrides`` by :func:`megatron_rl.models.builder`-style
config building. FP8 goes through Transformer Engine recipes selected by
Megatron's own fields (``fp8``, ``fp8_recipe``, ...); it is refused, with the
field to change, where Transformer Engine cannot run (no CUDA or TE missing).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from megatron.core.distributed import finalize_model_grads

from megatron_rl.config.schema import TrainConfig

# Per recipe: the fp8 format ('hybrid' = e4m3 forward, e5m2 backward) and the scaling settings TE needs.
FP8_RECIPE_FIELDS: dict[str, dict[str, Any]] = {
    "delayed": {"fp8": "hybrid", "fp8_amax_history_len": 1024, "fp8_amax_compute_algo": "max"},
    "tensorwise": {"fp8": "hybrid"},
    "blockwise": {"fp8": "e4m3"},
    "mxfp8": {"fp8": "e4m3"},
}


FP8_RECIPE_MIN_TE: dict[str, tuple[int, int, int]] = {
    "delayed": (2, 1, 0),
    "tensorwise": (2, 2, 0),
    "blockwise": (2, 3, 0),
    "mxfp8": (2, 1, 0),
}
"""The oldest Transformer Engine each recipe runs on under megatron-core 0.19.2 (``fp8_utils.get_fp8_recipe``; an
older TE falls back to delayed scaling or fails there). ``launch/requirements-gpu.lock`` pins 2.20.2."""

MXFP8_MIN_CAPABILITY = (10, 0)
"""MXFP8 GEMMs need Blackwell; Hopper (H100/H200) is 9.0."""


def params_dtype(train: TrainConfig) -> torch.dtype:
    """Model parameter dtype: fp32 for ``precision: fp32``; bf16 otherwise (FP8 GEMMs keep bf16 weights)."""
    return torch.float32 if train.precision == "fp32" else torch.bfloat16


def fp8_fields(
    train: TrainConfig,
    transformer_engine_problem: str | None,
    compute_capability: tuple[int, int] | None = None,
    transformer_engine_version: str | None = None,
) -> dict[str, Any]:
    """``fp8``, ``fp8_recipe`` and the recipe's scaling fields; empty unless ``train.precision`` is fp8.

    ``transformer_engine_problem``: why Transformer Engine is not usable here
    (:func:`~megatron_rl.parallel.device.transformer_engine_problem`), None when it is.
    ``compute_capability``: this process's GPU (``torch.cuda.get_device_capability()``), None when
    unknown. ``transformer_engine_version``: the installed TE's, None when unknown.

    Raises:
        ValueError: FP8 without a recipe, where Transformer Engine is not usable or older than the recipe
            needs (:data:`FP8_RECIPE_MIN_TE`), or mxfp8 on a GPU below compute capability 10.0.
    """
    if train.precision != "fp8":
        return {}
    if train.fp8_recipe is None:
        raise ValueError(f"train.precision=fp8 needs train.fp8_recipe, one of {sorted(FP8_RECIPE_FIELDS)}")
    if transformer_engine_problem is not None:
        raise ValueError(
            "train.precision=fp8 needs Transformer Engine on a CUDA device (FP8 GEMMs are TE kernels): "
            f"{transformer_engine_problem}; use train.precision=bf16 here"
        )
    needed = FP8_RECIPE_MIN_TE[train.fp8_recipe]
    if transformer_engine_version is not None and _release(transformer_engine_version) < needed:
        raise ValueError(
            f"train.fp8_recipe={train.fp8_recipe} needs Transformer Engine >= {'.'.join(map(str, needed))} "
            f"(megatron-core 0.19.2), this one is {transformer_engine_version}; install the GPU set "
            "(./launch/setup.sh --gpu) or pick another train.fp8_recipe"
        )
    if train.fp8_recipe == "mxfp8" and compute_capability is not None and compute_capability < MXFP8_MIN_CAPABILITY:
        major, minor = compute_capability
        raise ValueError(
            f"train.fp8_recipe=mxfp8 needs compute capability >= 10.0 (Blackwell); this GPU is {major}.{minor}; "
            "use blockwise, tensorwise or delayed"
        )
    return {"fp8_recipe": train.fp8_recipe, "fp8_param": False, **FP8_RECIPE_FIELDS[train.fp8_recipe]}


def _release(version: str) -> tuple[int, ...]:
    """A version string's leading numbers: ``2.3.0.dev0+abc`` -> (2, 3, 0)."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def recompute_fields(train: TrainConfig) -> dict[str, Any]:
    """Activation recompute: ``selective`` recomputes core attention; ``full`` every layer (uniform, 1 layer)."""
    if train.recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    if train.recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    return {}


def moe_loss_fields(train: TrainConfig) -> dict[str, Any]:
    """MoE load-balancing loss type and coefficient (off by default for RL)."""
    loss_type = "none" if train.moe_aux_loss_coef == 0 else train.moe_aux_loss_type
    return {"moe_router_load_balancing_type": loss_type, "moe_aux_loss_coeff": train.moe_aux_loss_coef}


def actor_config_overrides(
    train: TrainConfig,
    *,
    is_moe: bool,
    routing_replay: bool,
    transformer_engine_problem: str | None,
    compute_capability: tuple[int, int] | None = None,
    transformer_engine_version: str | None = None,
) -> dict[str, Any]:
    """All TransformerConfig overrides of a training actor.

    Always: the per-token-loss path (``calculate_per_token_loss``, with
    ``finalize_model_grads`` dividing gradients by the step's token count;
    the actor's loss function returns the loss times that count, so the
    result is exactly the aggregated loss of ``megatron_rl.algorithms``).

    Routing replay works with every recompute setting (recomputed forwards replay from
    Megatron's REPLAY_BACKWARD queue, :mod:`megatron_rl.actor.routing_replay`).

    Raises:
        ValueError: routing replay on a dense model; FP8 where it cannot run.
    """
    if routing_replay and not is_moe:
        raise ValueError("algorithm.routing_replay needs a MoE model; this model has no experts")
    fields: dict[str, Any] = {
        "calculate_per_token_loss": True,
        "finalize_model_grads_func": finalize_model_grads,
        **fp8_fields(train, transformer_engine_problem, compute_capability, transformer_engine_version),
        **recompute_fields(train),
    }
    if is_moe:
        fields |= moe_loss_fields(train) | {"moe_enable_routing_replay": routing_replay}
    return fields
