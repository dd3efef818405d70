"""Run a function on N gloo ranks on CPU: ``run_distributed(fn, world_size, *args)``.

A thin alias of :func:`megatron_rl.parallel.local_launch.run_local_ranks`
(fork by default, free port, torchrun environment, per-rank return values).
``fn`` must be a module-level function taking ``(rank, world_size, *args)``.
"""

from megatron_rl.parallel.local_launch import free_port
from megatron_rl.parallel.local_launch import run_local_ranks as run_distributed

__all__ = ["free_port", "run_distributed"]
