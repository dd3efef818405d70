"""Process groups: torch.distributed plus Megatron-core's model-parallel state.

One call, :func:`initialize_parallel`, takes plain parallel sizes and leaves the
process with (a) torch.distributed initialised from the launcher's environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, optional
``LOCAL_RANK``), NCCL on GPU and gloo on CPU, (b) Megatron's parallel state for
TP/PP/VPP/CP/EP/ETP and (c) Megatron's model-parallel RNG seeded. On CPU the
compatibility layer (:mod:`megatron_rl.parallel.cpu_compat`) is enabled first.
Rank 0 hosts the rendezvous store listening on ``MASTER_ADDR`` only
(:mod:`~megatron_rl.parallel.stores`), not on every interface as torch's ``env://``
does (under torchrun's agent store, torch's own rendezvous is used).
:func:`destroy_parallel` undoes (a)-(b) so that tests can re-initialise.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_rl.parallel import cpu_compat
from megatron_rl.parallel.device import collective_backend, select_device
from megatron_rl.parallel.stores import rendezvous_store


@dataclass(frozen=True)
class ParallelSizes:
    """Model-parallel sizes; data parallel is whatever the world size leaves.

    ``etp`` (expert tensor parallel) defaults to ``tp`` as in Megatron. ``vpp``
    is the number of model chunks per pipeline stage (``None``: no interleaving).
    ``first_stage_layers`` / ``last_stage_layers``: an uneven pipeline split
    (:mod:`megatron_rl.config.pipeline_split`; None: even).
    """

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size with Megatron's default applied."""
        return self.tp if self.etp is None else self.etp

    @property
    def min_world_size(self) -> int:
        """Smallest world size that fits both the dense and the expert layout (DP = 1 somewhere)."""
        return math.lcm(self.tp * self.pp * self.cp, self.expert_tp * self.ep * self.pp)

    def validate(self, world_size: int) -> None:
        """Raise ValueError naming the size that does not fit ``world_size``."""
        for name in ("tp", "pp", "cp", "ep", "expert_tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel size {name}={getattr(self, name)} must be >= 1")
        if self.vpp is not None and (self.vpp < 1 or self.pp < 2):
            raise ValueError(f"vpp={self.vpp} needs pp >= 2 and vpp >= 1 (use vpp=None without interleaving)")
        dense = self.tp * self.pp * self.cp
        if world_size % dense:
            raise ValueError(f"world size {world_size} is not divisible by tp*pp*cp = {dense}")
        expert = self.expert_tp * self.ep * self.pp
        if world_size % expert:
            raise ValueError(f"world size {world_size} is not divisible by etp*ep*pp = {expert}")


def initialize_parallel(sizes: ParallelSizes, *, seed: int = 1234, timeout_minutes: int = 30) -> torch.device:
    """Initialise torch.distributed, Megatron parallel state and RNG; return the device.

    torch.distributed is initialised only if it is not already (so a caller may
    set it up itself). Raises ValueError when the sizes do not fit the world.
    """
    device = select_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        cpu_compat.enable()
    if not dist.is_initialized():
        timeout = timedelta(minutes=timeout_minutes)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            dist.init_process_group(backend=collective_backend(), init_method="env://", timeout=timeout)
        else:
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            store = rendezvous_store(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, world_size, timeout=timeout
            )
            dist.init_process_group(
                backend=collective_backend(),
                store=dist.PrefixStore("default_pg", store),
                rank=rank,
                world_size=world_size,
                timeout=timeout,
            )
    sizes.validate(dist.get_world_size())

    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=sizes.tp,
        pipeline_model_parallel_size=sizes.pp,
        virtual_pipeline_model_parallel_size=sizes.vpp,
        context_parallel_size=sizes.cp,
        expert_model_parallel_size=sizes.ep,
        expert_tensor_parallel_size=sizes.expert_tp,
        distributed_timeout_minutes=timeout_minutes,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return device


def destroy_parallel() -> None:
    """Tear down Megatron's parallel state and the default process group."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
