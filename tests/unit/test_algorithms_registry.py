"""Name registries for advantage estimators and policy losses, and the package's import boundary."""

import subprocess
import sys
from typing import Any

import pytest
import torch

from megatron_rl.algorithms import (
    PolicyLoss,
    get_advantage_estimator,
    get_policy_loss,
    grpo_advantages,
    gspo_loss,
    ppo_clip_loss,
    register_policy_loss,
    registry,
)


def test_builtins_are_registered_by_name() -> None:
    assert get_advantage_estimator("grpo") is grpo_advantages
    assert get_policy_loss("ppo_clip") is ppo_clip_loss
    assert get_policy_loss("gspo") is gspo_loss


def test_unknown_name_raises_listing_registered_names() -> None:
    with pytest.raises(ValueError, match=r"'gspo', 'ppo_clip'"):
        get_policy_loss("vanilla")
    with pytest.raises(ValueError, match="grpo"):
        get_advantage_estimator("rloo")


def test_registered_function_is_returned_unchanged_and_found_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "POLICY_LOSSES", registry.Registry("policy loss"))

    @register_policy_loss("custom")
    def custom_loss(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return ppo_clip_loss(*args, **kwargs)

    assert get_policy_loss("custom") is custom_loss


def test_duplicate_or_empty_name_is_refused() -> None:
    losses: registry.Registry[PolicyLoss] = registry.Registry("policy loss")
    losses.register("a")(ppo_clip_loss)
    with pytest.raises(ValueError, match="already registered"):
        losses.register("a")(gspo_loss)
    with pytest.raises(ValueError, match="non-empty"):
        losses.register("")


def test_importing_algorithms_pulls_in_neither_megatron_nor_ray_nor_transformers() -> None:
    probe = (
        "import sys, megatron_rl.algorithms; "
        "print(sorted(m for m in ('megatron', 'ray', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
