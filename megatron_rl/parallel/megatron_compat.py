"""Workarounds for defects of megatron-core 0.19.2, each scoped to where it bites.

Every Megatron change that is not about running on CPU lives here (the CPU layer is
:mod:`megatron_rl.parallel.cpu_compat`). Each entry names the megatron-core version it was
written against and why; the tests that pin them are
``tests/distributed/test_megatron_state_resume.py`` (resume into another layout with torch's
Adam) and ``tests/e2e/test_exact_resume.py`` (bitwise resume).

| workaround | megatron-core | defect |
| --- | --- | --- |
| :func:`initialize_empty_adam_state` | 0.19.2 | saving or loading a torch Adam that has not stepped yet asserts on a missing ``step`` |
| :func:`step_hidden_while_setting_param_state` | 0.19.2 | resharded load into torch Adam raises ``KeyError: 'step'`` (a method swapped while loading) |
| :func:`unshare_adam_steps` | 0.19.2 | the restored ``step`` is one tensor shared by all parameters |

All three apply only without Transformer Engine or apex (torch's Adam); with them megatron-core
uses its fused Adam and the functions change nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from megatron.core.optimizer import MegatronOptimizer, distrib_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer


def _torch_adams(parts: Sequence[MegatronOptimizer]) -> list[torch.optim.Optimizer]:
    return [part.optimizer for part in parts if isinstance(part.optimizer, torch.optim.Adam | torch.optim.AdamW)]


def initialize_empty_adam_state(parts: Sequence[MegatronOptimizer]) -> None:
    """Give a fresh torch Adam the state entries a first step would create (step 0, zero moments).

    Megatron's distributed optimizer reads ``state[p]["step"]`` when building the sharded state
    dict to load into; without Transformer Engine or apex it uses torch's Adam, whose state is
    empty until the first step (megatron-core 0.19.2 then fails ``assert len(steps) == 1``, on
    load and also on a save before the first update, e.g. after steps whose dynamic sampling
    kept nothing). The values are the state torch's Adam starts from (a CPU step of 0.0, zero
    moments), so an update after them is the update of a fresh optimizer; loading overwrites them.
    """
    for adam in _torch_adams(parts):
        for group in adam.param_groups:
            for param in group["params"]:
                if not adam.state[param]:
                    adam.state[param] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(param),
                        "exp_avg_sq": torch.zeros_like(param),
                    }


@contextmanager
def step_hidden_while_setting_param_state() -> Iterator[None]:
    """Work around megatron-core 0.19.2 loading a resharded optimizer state into torch's Adam.

    Without Transformer Engine or apex, the distributed optimizer wraps ``torch.optim.Adam``,
    whose per-parameter state holds a ``step`` tensor. ``_set_main_param_and_optimizer_states``
    copies every tensor of that state from the checkpoint's per-parameter state, which never
    holds ``step`` (Megatron restores it separately), and fails with ``KeyError: 'step'``. While
    loading, this hides ``step`` from each parameter's state during that copy. With Transformer
    Engine or apex installed (GPU clusters) nothing is changed.
    """
    if distrib_optimizer.HAVE_APEX_OR_TE:
        yield
        return
    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_without_step(self: DistributedOptimizer, model_param: torch.Tensor, tensors: dict[str, Any]) -> None:
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        try:
            original(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    DistributedOptimizer._set_main_param_and_optimizer_states = set_without_step
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = original


def unshare_adam_steps(parts: Sequence[MegatronOptimizer]) -> None:
    """Give every parameter its own ``step`` tensor after a load.

    megatron-core 0.19.2 restores torch Adam's step as ONE tensor object shared by all
    parameters; torch's Adam increments ``step`` in place per parameter, so a shared tensor
    would advance once per parameter per update and corrupt the bias correction.
    """
    for adam in _torch_adams(parts):
        for state in adam.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
