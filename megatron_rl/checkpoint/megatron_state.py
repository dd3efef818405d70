"""The trainer's Megatron state in a run checkpoint: model weights, optimizer state and LR schedule.

Model and optimizer go into one ``torch_dist`` checkpoint under ``<checkpoint>/megatron``.
The distributed optimizer's state is saved ``fully_reshardable`` (gathered into a canonical
per-parameter form), so a run saved at one TP/PP/EP layout resumes at another with the same
weights and Adam moments. The LR/weight-decay schedule (a few numbers) is saved by rank 0 as
``<checkpoint>/scheduler.pt``. Every rank of the trainer calls these functions together.

The optimizer's part of the checkpoint does not depend on how megatron-core splits the
optimizer. For a MoE model megatron-core 0.19.2 builds one optimizer at EP 1 (expert weights
in the dense parameter groups) but a chain of two at EP > 1 (dense, expert), whose own
checkpoint keys differ (``chained_0.`` / ``chained_1.`` prefixes, one common entry per part).
A part without parameters is a stub with no torch optimizer (the dense part when LoRA adapts only the
experts, at EP > 1): it has no state, and this module leaves it out. Whatever the layout, this module writes
what one unchained distributed optimizer writes:

* per model parameter, tensors ``optimizer.state.<name>.<parameter key>`` (``exp_avg``,
  ``exp_avg_sq`` and ``param``, the fp32 main parameter); parameter keys are unique in the
  model, so no prefix is needed;
* in the common state, ``optimizer.optimizer.param_groups``: the hyperparameters of every
  parameter group of every part (``lr``, ``weight_decay``, betas, eps, ``step``, ...), each
  tagged with megatron-core's ``is_expert_parallel``.

On load, each parameter group of the current optimizer takes the saved group with the same
identity (megatron-core's ``param_group_identifier_keys``: ``wd_mult``, ``lr_mult``,
``max_lr``, ...) apart from the expert flag; where the saved dense and expert groups of one
identity differ, the checkpoint cannot be mapped and loading fails naming them.
Checkpoints written before this format at EP 1 load; those written at EP > 1 (chained
keys) cannot be resumed, and loading says so before reading any tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer.optimizer import param_group_identifier_keys
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_rl.checkpoint.layout import MEGATRON_DIR, SCHEDULER_FILE
from megatron_rl.parallel.megatron_compat import (
    initialize_empty_adam_state,
    step_hidden_while_setting_param_state,
    unshare_adam_steps,
)

if TYPE_CHECKING:
    from megatron.core.transformer.module import MegatronModule

_SHARDING_TYPE = "fully_reshardable"
# Without the prefix flag a ChainedOptimizer prefixes its parts' tensor keys with ``chained_<i>.``.
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": _SHARDING_TYPE, "chained_optim_avoid_prefix": True}
_PART_KEYS = {"optimizer", "param_state", "param_state_sharding_type"}
_EXPERT_FLAG = "is_expert_parallel"


def _model_state(chunks: Sequence[MegatronModule]) -> dict[str, Any]:
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def _optimizer_parts(optimizer: MegatronOptimizer) -> list[MegatronOptimizer]:
    """The optimizers megatron-core chained (dense, then expert at EP > 1), or ``[optimizer]``, without stubs.

    megatron-core's chain cannot save or load around a stub (``ChainedOptimizer._synchronize_steps`` reads its
    missing torch optimizer), so this module calls each part itself. What the chain adds, aligning Transformer
    Engine's per-group ``step`` over the groups that hold parameters, changes nothing: every update advances them
    together.
    """
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [part for part in parts if not getattr(part, "is_stub_optimizer", False)]


def _sharded_optimizer_parts(
    optimizer: MegatronOptimizer, model_state: dict[str, Any], *, is_loading: bool
) -> list[dict[str, Any]]:
    """One sharded state dict per optimizer part, in part order, with unprefixed tensor keys.

    Each holds ``optimizer`` (``param_groups``), ``param_state`` (per-parameter tensors keyed
    ``optimizer.state.<name>.<parameter key>``) and ``param_state_sharding_type``. Raises
    NotImplementedError for any other entry (an fp16 loss scaler's state), which this
    checkpoint format does not carry.
    """
    parts = [
        part.sharded_state_dict(model_state, is_loading=is_loading, metadata=_OPTIMIZER_METADATA)
        for part in _optimizer_parts(optimizer)
    ]
    for part in parts:
        if set(part) != _PART_KEYS:
            raise NotImplementedError(
                f"optimizer state entries {sorted(set(part) - _PART_KEYS)} are not saved in run checkpoints; "
                "train in bf16 or fp32 without a loss scaler"
            )
    return parts


def _layout_free_optimizer_state(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The optimizer state to save: all parts' parameter groups in one list, tensors keyed per parameter."""
    return {
        "optimizer": {"param_groups": [group for part in parts for group in part["optimizer"]["param_groups"]]},
        "param_state": {i: part["param_state"] for i, part in enumerate(parts)},
        "param_state_sharding_type": _SHARDING_TYPE,
    }


def _saved_param_groups(source: Path) -> list[dict[str, Any]]:
    """The parameter groups saved in ``source`` (a ``torch_dist`` checkpoint), read before any tensor.

    Raises ValueError for a checkpoint without optimizer state, or one whose optimizer state is
    split by megatron-core's chaining (written at EP > 1 by an earlier megatron-rl), naming the way out.
    """
    saved = dist_checkpointing.load_common_state_dict(str(source)).get("optimizer")
    if saved is None:
        raise ValueError(f"{source}: holds no optimizer state (a model-only checkpoint?); start a run from its weights")
    if "optimizer" not in saved:
        raise ValueError(
            f"{source}: the optimizer state is in megatron-core's chained per-part form (parts {sorted(saved)}), "
            "written at EP > 1 by an earlier megatron-rl; it cannot be resumed. Export its weights with "
            f"`megatron-rl convert mcore-to-hf --ckpt {source.parent} ...` and start a new run from them (model.path)"
        )
    groups: list[dict[str, Any]] = saved["optimizer"]["param_groups"]
    return groups


def _group_identity(group: dict[str, Any]) -> dict[str, Any]:
    """What tells megatron-core's parameter groups apart, except whether they are expert-parallel."""
    return {key: group.get(key) for key in param_group_identifier_keys if key != _EXPERT_FLAG}


def _without_expert_flag(group: dict[str, Any]) -> dict[str, Any]:
    """``group`` without megatron-core's ``is_expert_parallel`` tag."""
    return {key: value for key, value in group.items() if key != _EXPERT_FLAG}


def _param_groups_for(
    part: MegatronOptimizer, saved_groups: Sequence[dict[str, Any]], source: Path
) -> list[dict[str, Any]]:
    """The saved hyperparameters for each of ``part``'s parameter groups, tagged with the group's expert flag.

    A group takes the saved groups of its identity (:func:`_group_identity`); dense and expert
    groups saved at EP > 1 map onto the one group of EP 1 and back. Raises ValueError naming
    the group when ``source`` holds none of its identity, or several that differ.
    """
    groups = []
    for group in part.optimizer.param_groups:
        identity = _group_identity(group)
        matches = [saved for saved in saved_groups if _group_identity(saved) == identity]
        if not matches:
            raise ValueError(
                f"{source}: no optimizer parameter group with {identity}; the checkpoint has "
                f"{[_group_identity(saved) for saved in saved_groups]}. Resume with the optimizer settings "
                "(lr, min_lr, per-parameter overrides) it was saved with"
            )
        unflagged = [_without_expert_flag(match) for match in matches]
        differing = sorted({key for match in unflagged for key in match if match.get(key) != unflagged[0].get(key)})
        if differing:
            raise ValueError(
                f"{source}: the saved dense and expert optimizer groups with {identity} differ in {differing}, so "
                "they cannot become one group at this layout; resume at the expert-parallel size it was saved with"
            )
        groups.append(matches[0] | {_EXPERT_FLAG: group[_EXPERT_FLAG]})  # the saved key order stays
    return groups


def save_megatron_state(
    chunks: Sequence[torch.nn.Module],
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    checkpoint_dir: str | Path,
) -> None:
    """Write this rank's shards of model and optimizer, and (rank 0) the schedule, into ``checkpoint_dir``."""
    target = Path(checkpoint_dir) / MEGATRON_DIR
    if dist.get_rank() == 0:
        target.mkdir(parents=True, exist_ok=True)
        torch.save(scheduler.state_dict(), Path(checkpoint_dir) / SCHEDULER_FILE)
    dist.barrier()
    initialize_empty_adam_state(_optimizer_parts(optimizer))  # a run saved before its first update
    model_state = _model_state(chunks)
    parts = _sharded_optimizer_parts(optimizer, model_state, is_loading=False)
    state = model_state | {"optimizer": _layout_free_optimizer_state(parts)}
    # The default 'spawn' results queue re-imports torch in a new process (tens of seconds on small CPU hosts).
    filesystem_async.get_write_results_queue(mp_mode="fork")
    dist_checkpointing.save(state, str(target))


def load_megatron_state(
    chunks: Sequence[torch.nn.Module],
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    checkpoint_dir: str | Path,
) -> None:
    """Restore model, optimizer and schedule from ``checkpoint_dir``, saved at this or any other layout.

    Raises FileNotFoundError naming the missing part, RuntimeError naming missing parameters,
    ValueError for optimizer state that cannot be mapped onto this optimizer (see the module docstring).
    """
    source = Path(checkpoint_dir) / MEGATRON_DIR
    scheduler_file = Path(checkpoint_dir) / SCHEDULER_FILE
    for required in (source, scheduler_file):
        if not required.exists():
            raise FileNotFoundError(f"{required}: missing; {checkpoint_dir} holds no Megatron training state")
    saved_groups = _saved_param_groups(source)
    param_groups = [_param_groups_for(part, saved_groups, source) for part in _optimizer_parts(optimizer)]
    initialize_empty_adam_state(_optimizer_parts(optimizer))
    model_state = _model_state(chunks)
    parts = _sharded_optimizer_parts(optimizer, model_state, is_loading=True)
    request = {"param_state": {i: part["param_state"] for i, part in enumerate(parts)}}
    loaded = dist_checkpointing.load(model_state | {"optimizer": request}, str(source))
    for i, chunk in enumerate(chunks):
        result = chunk.load_state_dict(loaded[f"model{i}"], strict=False)
        missing = [key for key in result.missing_keys if not key.endswith("_extra_state")]
        if missing:
            raise RuntimeError(f"{source} lacks parameters {missing} of model chunk {i}")
    part_states = [
        {
            "optimizer": {"param_groups": groups},
            "param_state": loaded["optimizer"]["param_state"][i],
            "param_state_sharding_type": _SHARDING_TYPE,
        }
        for i, groups in enumerate(param_groups)
    ]
    with step_hidden_while_setting_param_state():
        for part, part_state in zip(_optimizer_parts(optimizer), part_states, strict=True):
            part.load_state_dict(part_state)
    unshare_adam_steps(_optimizer_parts(optimizer))
    scheduler.load_state_dict(torch.load(scheduler_file, weights_only=False))
