"""One trainer rank's part of a run checkpoint: its Megatron shards and its generator states.

Every rank of the trainer calls these together (the Megatron parts are collective).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_rl.checkpoint.layout import MEGATRON_RNG_TRACKER_KEY
from megatron_rl.checkpoint.megatron_state import load_megatron_state, save_megatron_state
from megatron_rl.checkpoint.rng import load_rng_state, reseed_generators, save_rng_state


def save_rank_state(
    chunks: Sequence[torch.nn.Module],
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    directory: str | Path,
) -> None:
    """Write model, optimizer and schedule shards and this rank's generator states into ``directory``.

    Returns after every rank has written (a barrier ends it).
    """
    save_megatron_state(chunks, optimizer, scheduler, directory)
    tracker_states = tensor_parallel.get_cuda_rng_tracker().get_states()
    save_rng_state(directory, dist.get_rank(), extra={MEGATRON_RNG_TRACKER_KEY: tracker_states})
    dist.barrier()


def load_rank_state(
    chunks: Sequence[torch.nn.Module],
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    directory: str | Path,
    *,
    reseed: int | None = None,
) -> None:
    """Restore what :func:`save_rank_state` wrote: model, optimizer, schedule and generator states.

    The checkpoint may come from any TP/PP/EP layout. Generator states belong to the rank that
    saved them, so pass ``reseed`` when the layout differs: every generator (Megatron's
    model-parallel ones included) is then seeded from it instead of restored.
    """
    load_megatron_state(chunks, optimizer, scheduler, directory)
    if reseed is None:
        extra = load_rng_state(directory, dist.get_rank())
        tensor_parallel.get_cuda_rng_tracker().set_states(extra[MEGATRON_RNG_TRACKER_KEY])
    else:
        reseed_generators(reseed)
        tensor_parallel.model_parallel_cuda_manual_seed(reseed)
