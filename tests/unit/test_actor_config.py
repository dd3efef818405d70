"""The actor's TransformerConfig overrides: precision, FP8 refusal, recompute, MoE losses, replay; its temperature."""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path

import megatron.core
import pytest
import torch

from megatron_rl.actor.policy_actor import PolicyActor
from megatron_rl.actor.precision import FP8_RECIPE_FIELDS, FP8_RECIPE_MIN_TE, actor_config_overrides, params_dtype
from megatron_rl.config.schema import AlgorithmConfig, ParallelConfig, TrainConfig


def _train(**fields) -> TrainConfig:
    return TrainConfig(steps=1, prompts_per_step=1, **fields)


NO_GPU = "this process sees no CUDA device"


def _overrides(train: TrainConfig, *, te: bool = False, replay: bool = False, moe: bool = True) -> dict:
    problem = None if te else NO_GPU
    return actor_config_overrides(train, is_moe=moe, routing_replay=replay, transformer_engine_problem=problem)


def test_per_token_loss_path_is_always_on():
    fields = _overrides(_train())
    assert fields["calculate_per_token_loss"] is True
    assert fields["finalize_model_grads_func"].__name__ == "finalize_model_grads"


def test_params_dtype_follows_precision():
    assert params_dtype(_train(precision="fp32")) == torch.float32
    assert params_dtype(_train(precision="bf16")) == torch.bfloat16
    assert params_dtype(_train(precision="fp8", fp8_recipe="blockwise")) == torch.bfloat16


@pytest.mark.parametrize("recipe", sorted(FP8_RECIPE_FIELDS))
def test_fp8_recipe_sets_megatron_fp8_fields_when_transformer_engine_runs(recipe):
    fields = _overrides(_train(precision="fp8", fp8_recipe=recipe), te=True)
    assert fields["fp8_recipe"] == recipe
    assert fields["fp8"] in ("e4m3", "hybrid")
    assert fields["fp8_param"] is False


@pytest.mark.parametrize(("capability", "accepted"), [((8, 9), False), ((9, 0), False), ((10, 0), True)])
def test_mxfp8_needs_compute_capability_10(capability, accepted):
    def overrides() -> dict:
        train = _train(precision="fp8", fp8_recipe="mxfp8")
        return actor_config_overrides(
            train, is_moe=True, routing_replay=False, transformer_engine_problem=None, compute_capability=capability
        )

    if accepted:
        assert overrides()["fp8_recipe"] == "mxfp8"
        return
    major, minor = capability
    with pytest.raises(
        ValueError, match=rf"mxfp8 needs compute capability >= 10.0 \(Blackwell\); this GPU is {major}.{minor}"
    ):
        overrides()


def test_fp8_is_refused_without_transformer_engine_naming_the_field():
    with pytest.raises(
        ValueError, match=rf"needs Transformer Engine on a CUDA device .*: {NO_GPU}; use train.precision"
    ):
        _overrides(_train(precision="fp8", fp8_recipe="tensorwise"), te=False)


def test_fp8_without_recipe_is_refused():
    with pytest.raises(ValueError, match="train.fp8_recipe"):
        _overrides(_train(precision="fp8"), te=True)


def test_recompute_options_map_to_megatron_fields():
    assert _overrides(_train(recompute="selective"))["recompute_modules"] == ["core_attn"]
    full = _overrides(_train(recompute="full"))
    assert (full["recompute_granularity"], full["recompute_method"], full["recompute_num_layers"]) == (
        "full",
        "uniform",
        1,
    )
    assert "recompute_granularity" not in _overrides(_train())


def test_moe_aux_loss_is_off_by_default_and_set_from_the_recipe():
    assert _overrides(_train())["moe_router_load_balancing_type"] == "none"
    fields = _overrides(_train(moe_aux_loss_type="seq_aux_loss", moe_aux_loss_coef=1e-3))
    assert (fields["moe_router_load_balancing_type"], fields["moe_aux_loss_coeff"]) == ("seq_aux_loss", 1e-3)
    assert "moe_aux_loss_coeff" not in _overrides(_train(), moe=False)


def test_routing_replay_sets_the_megatron_flag_with_any_recompute_and_refuses_dense_models():
    assert _overrides(_train(), replay=True)["moe_enable_routing_replay"] is True
    full = _overrides(_train(recompute="full"), replay=True)
    assert full["moe_enable_routing_replay"] is True and full["recompute_granularity"] == "full"
    with pytest.raises(ValueError, match="needs a MoE model"):
        _overrides(_train(), replay=True, moe=False)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("inf")])
def test_actor_refuses_a_temperature_it_cannot_train_at(temperature):
    with pytest.raises(ValueError, match=r"temperature must be a finite number > 0 .* got"):
        PolicyActor({}, ParallelConfig(), _train(), AlgorithmConfig(), norm_constant=1.0, temperature=temperature)


def test_a_transformer_engine_older_than_the_recipe_needs_is_refused_naming_both():
    train = _train(precision="fp8", fp8_recipe="blockwise")
    overrides = partial(
        actor_config_overrides, train, is_moe=True, routing_replay=False, transformer_engine_problem=None
    )
    with pytest.raises(ValueError, match=r"blockwise needs Transformer Engine >= 2.3.0 .* this one is 2.2.1"):
        overrides(transformer_engine_version="2.2.1")
    assert overrides(transformer_engine_version="2.3.0.dev0+1a2b")["fp8_recipe"] == "blockwise"


def test_the_te_each_recipe_needs_is_what_megatron_core_asks_and_the_gpu_lock_has_it():
    """megatron-core 0.19.2's ``get_fp8_recipe`` gates each recipe on a TE version; the GPU lock's TE meets all."""
    source = (Path(megatron.core.__file__).parent / "fp8_utils.py").read_text()
    assert 'if is_te_min_version("2.1.0"):' in source  # every recipe but delayed needs at least this
    assert 'Fp8Recipe.tensorwise and is_te_min_version("2.2.0.dev0")' in source
    assert 'Fp8Recipe.blockwise and is_te_min_version("2.3.0.dev0")' in source
    assert FP8_RECIPE_MIN_TE == {
        "delayed": (2, 1, 0),
        "tensorwise": (2, 2, 0),
        "blockwise": (2, 3, 0),
        "mxfp8": (2, 1, 0),
    }
    lock = (Path(__file__).parents[2] / "launch" / "requirements-gpu.lock").read_text()
    (pinned,) = re.findall(r"^transformer_engine==(\d+)\.(\d+)\.(\d+)$", lock, flags=re.M)
    assert tuple(map(int, pinned)) >= max(FP8_RECIPE_MIN_TE.values())
