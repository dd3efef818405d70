"""The trainer's Megatron state in a run checkpoint: model weights, optimizer state and LR schedule.

Model and optimizer go into one ``torch_dist`` checkpoint under ``<checkpoint>/megatron``.
The distributed optimizer's state is saved ``fully_reshardable`` (gathered into a canonical
per-parameter form), so a run saved at one TP/PP/EP layout resumes at another with the same
weights and Adam moments. The LR/weight-decay schedule (a few numbers) is saved by rank 0 as
``<checkpoint>/scheduler.pt``. Every rank of the trainer calls these functions together.

Known limit (megatron-core 0.19.2): a MoE model's optimizer is one optimizer at EP 1 and a
chain of two (dense, expert) at EP > 1, with different state keys, so a resume that moves EP
between 1 and > 1 cannot load the optimizer state; TP, PP and EP changes among EP > 1
layouts (and among EP 1 layouts) work.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.optimizer import MegatronOptimizer, distrib_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

MEGATRON_DIR = "megatron"
SCHEDULER_FILE = "scheduler.pt"
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _model_state(chunks: Sequence[torch.nn.Module]) -> dict:
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def _torch_adams(optimizer: MegatronOptimizer) -> list[torch.optim.Optimizer]:
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [part.optimizer for part in parts if isinstance(part.optimizer, torch.optim.Adam | torch.optim.AdamW)]


def _initialize_empty_adam_state(optimizer: MegatronOptimizer) -> None:
    """Give a fresh torch Adam the state entries a first step would create (step 0, zero moments).

    Megatron's distributed optimizer reads ``state[p]["step"]`` when building the sharded state
    dict to load into; without Transformer Engine or apex it uses torch's Adam, whose state is
    empty until the first step (megatron-core 0.19.2 then fails ``assert len(steps) == 1``). The
    values are placeholders: loading overwrites all of them.
    """
    for adam in _torch_adams(optimizer):
        for group in adam.param_groups:
            for param in group["params"]:
                if not adam.state[param]:
                    adam.state[param] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(param),
                        "exp_avg_sq": torch.zeros_like(param),
                    }


@contextmanager
def _step_hidden_while_setting_param_state() -> Iterator[None]:
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

    def set_without_step(self: DistributedOptimizer, model_param: torch.Tensor, tensors: dict) -> None:
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


def _unshare_adam_steps(optimizer: MegatronOptimizer) -> None:
    """Give every parameter its own ``step`` tensor after a load.

    megatron-core 0.19.2 restores torch Adam's step as ONE tensor object shared by all
    parameters; torch's Adam increments ``step`` in place per parameter, so a shared tensor
    would advance once per parameter per update and corrupt the bias correction.
    """
    for adam in _torch_adams(optimizer):
        for state in adam.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


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
    model_state = _model_state(chunks)
    state = model_state | {
        "optimizer": optimizer.sharded_state_dict(model_state, is_loading=False, metadata=_OPTIMIZER_METADATA)
    }
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

    Raises FileNotFoundError naming the missing part, RuntimeError naming missing parameters.
    """
    source = Path(checkpoint_dir) / MEGATRON_DIR
    scheduler_file = Path(checkpoint_dir) / SCHEDULER_FILE
    for required in (source, scheduler_file):
        if not required.exists():
            raise FileNotFoundError(f"{required}: missing; {checkpoint_dir} holds no Megatron training state")
    _initialize_empty_adam_state(optimizer)
    model_state = _model_state(chunks)
    state = model_state | {
        "optimizer": optimizer.sharded_state_dict(model_state, is_loading=True, metadata=_OPTIMIZER_METADATA)
    }
    loaded = dist_checkpointing.load(state, str(source))
    for i, chunk in enumerate(chunks):
        result = chunk.load_state_dict(loaded[f"model{i}"], strict=False)
        missing = [key for key in result.missing_keys if not key.endswith("_extra_state")]
        if missing:
            raise RuntimeError(f"{source} lacks parameters {missing} of model chunk {i}")
    with _step_hidden_while_setting_param_state():
        optimizer.load_state_dict(loaded["optimizer"])
    _unshare_adam_steps(optimizer)
    scheduler.load_state_dict(torch.load(scheduler_file, weights_only=False))
