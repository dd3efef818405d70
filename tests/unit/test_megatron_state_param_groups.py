"""Optimizer parameter groups of a run checkpoint mapped onto the optimizer of another expert-parallel layout."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_rl.checkpoint.megatron_state import _param_groups_for

SOURCE = Path("/ckpt/step_000002/megatron")


def _group(*, expert: bool, wd_mult: float = 1.0, step: float = 3.0) -> dict:
    """A saved group as megatron-core 0.19.2 writes it (torch Adam: ``step`` in the group)."""
    return {
        "is_expert_parallel": expert,
        "wd_mult": wd_mult,
        "lr_mult": 1.0,
        "max_lr": 0.05,
        "min_lr": 0.0,
        "lr": 0.025,
        "betas": (0.9, 0.999),
        "step": step,
    }


def _part(*groups: dict) -> SimpleNamespace:
    """An optimizer part whose torch optimizer holds ``groups`` (with parameters)."""
    return SimpleNamespace(optimizer=SimpleNamespace(param_groups=[group | {"params": []} for group in groups]))


def test_dense_and_expert_groups_saved_at_ep2_become_the_groups_of_ep1() -> None:
    saved = [_group(expert=False), _group(expert=False, wd_mult=0.0), _group(expert=True)]
    ep1 = _part(_group(expert=False, step=0.0), _group(expert=False, wd_mult=0.0, step=0.0))
    assert _param_groups_for(ep1, saved, SOURCE) == [_group(expert=False), _group(expert=False, wd_mult=0.0)]


def test_groups_saved_at_ep1_become_the_dense_and_expert_groups_of_ep2() -> None:
    saved = [_group(expert=False), _group(expert=False, wd_mult=0.0)]
    dense = _part(_group(expert=False, step=0.0), _group(expert=False, wd_mult=0.0, step=0.0))
    expert = _part(_group(expert=True, step=0.0))
    assert _param_groups_for(dense, saved, SOURCE) == saved
    assert _param_groups_for(expert, saved, SOURCE) == [_group(expert=True)]


def test_dense_and_expert_groups_that_differ_cannot_be_merged() -> None:
    saved = [_group(expert=False, step=3.0), _group(expert=True, step=2.0)]
    with pytest.raises(
        ValueError, match=r"/ckpt/step_000002/megatron: the saved dense and expert .* differ in \[.step.\]"
    ):
        _param_groups_for(_part(_group(expert=False)), saved, SOURCE)


def test_a_group_the_checkpoint_lacks_is_named() -> None:
    with pytest.raises(ValueError, match=r"no optimizer parameter group with .*'wd_mult': 0.0"):
        _param_groups_for(_part(_group(expert=False, wd_mult=0.0)), [_group(expert=False)], SOURCE)
