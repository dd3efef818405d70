"""One trainer rank's probe of its device and of the recipe's process groups, hosted by a Ray rank worker.

The probe joins torch.distributed and Megatron's parallel state exactly as a trainer rank does (same
backend, same sizes, the run's network), then :meth:`DeviceProbe.gemm` checks and times a GEMM on its
device and :meth:`DeviceProbe.collectives` times all-reduce, all-gather and all-to-all on each of the
recipe's groups (TP, CP, DP, EP, PP) and a broadcast over the whole world, the way a weight sync sends.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.config.schema import RunConfig

GEMM_SIZE = {"cuda": 8192, "cpu": 256}
"""Side of the square GEMM per device type: 1.1 TFLOP on a GPU (milliseconds), small enough for a CPU rank."""
COLLECTIVE_BYTES = {"cuda": 256 << 20, "cpu": 4 << 20}
"""Bytes per rank of each timed collective: large enough to measure bandwidth, not latency."""
REPEATS = 5


def _gemm_error_bound(dtype: torch.dtype, inner: int) -> float:
    """Relative error bound of one output of a GEMM in ``dtype``, against ``sum |a| |b|``: accumulation in fp32
    (bf16/fp16 GEMMs accumulate in fp32 on tensor cores) over ``inner`` terms plus the output's rounding."""
    accumulate = inner * torch.finfo(torch.float32).eps
    return accumulate + torch.finfo(dtype).eps


class DeviceProbe:
    """A rank of the recipe's trainer layout that measures instead of training.

    Args:
        cfg: the run's recipe; its parallel sizes build the process groups, ``train.precision`` picks the GEMM
            dtype (bf16 on a GPU unless fp32; fp32 on CPU, as the trainer runs there).
        joins_groups: a trainer rank (the recipe's process groups); False for a disaggregated engine's GPU, which
            runs :meth:`gemm` only.
    """

    def __init__(self, cfg: RunConfig, *, joins_groups: bool = True) -> None:
        from megatron_rl.actor.policy_actor import parallel_sizes
        from megatron_rl.parallel.device import select_device
        from megatron_rl.parallel.distributed import initialize_parallel

        self.rank = int(os.environ["RANK"])
        self.label = f"rank {self.rank}" if joins_groups else f"engine GPU {self.rank}"
        self.host = socket.gethostname()
        if joins_groups:
            self.device = initialize_parallel(parallel_sizes(cfg.parallel), seed=cfg.train.seed)
            hosts: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(hosts, self.host)
            self.hosts: list[str] = hosts
        else:  # an engine's GPU: a GEMM only, no process group
            self.device = select_device()
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
        cuda = self.device.type == "cuda"
        self.dtype = torch.bfloat16 if cuda and cfg.train.precision != "fp32" else torch.float32

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _best_seconds(self, action: Callable[[], object]) -> float:
        """Best of :data:`REPEATS` runs of ``action`` (after one warm-up), device work included."""
        action()
        self._synchronize()
        best = float("inf")
        for _ in range(REPEATS):
            started = time.perf_counter()
            action()
            self._synchronize()
            best = min(best, time.perf_counter() - started)
        return best

    def where(self) -> str:
        """``rank 3 (host:gpu3)`` (``engine GPU k`` for an engine's, ``host:cpu`` on CPU): how a report names it."""
        device = f"gpu{torch.cuda.current_device()}" if self.device.type == "cuda" else "cpu"
        return f"{self.label} ({self.host}:{device})"

    def gemm(self) -> dict[str, Any]:
        """A ``GEMM_SIZE`` square GEMM in the probe's dtype, checked element by element against fp64 and timed.

        Returns ``where``, ``device_name``, ``tflops`` (best of :data:`REPEATS`), ``max_error_ratio`` (the largest
        ``|c - c64| / bound``, <= 1 on a sound device; the bound is :func:`_gemm_error_bound` times
        ``(|A| @ |B|)``) and ``ok``. Inputs are seeded by rank, so a faulty device's result is repeatable.
        """
        size = GEMM_SIZE[self.device.type]
        generator = torch.Generator().manual_seed(1000 + self.rank)
        a = torch.randn(size, size, generator=generator).to(self.dtype)
        b = torch.randn(size, size, generator=generator).to(self.dtype)
        reference = a.double() @ b.double()  # on the host: the device's fp64 is what is being checked
        scale = a.double().abs() @ b.double().abs()
        a, b = a.to(self.device), b.to(self.device)
        product = (a @ b).double().cpu()
        ratio = float(((product - reference).abs() / (_gemm_error_bound(self.dtype, size) * scale)).max())
        seconds = self._best_seconds(lambda: a @ b)
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "CPU"
        return {
            "where": self.where(),
            "device_name": name,
            "dtype": str(self.dtype).removeprefix("torch."),
            "size": size,
            "tflops": 2 * size**3 / seconds / 1e12,
            "max_error_ratio": ratio,
            "ok": ratio <= 1.0,
        }

    def _groups(self) -> dict[str, Any]:
        from megatron.core import parallel_state as ps

        return {
            "tp": ps.get_tensor_model_parallel_group(),
            "cp": ps.get_context_parallel_group(),
            "dp": ps.get_data_parallel_group(),
            "ep": ps.get_expert_model_parallel_group(),
            "pp": ps.get_pipeline_model_parallel_group(),
        }

    def _spans_nodes(self, group: Any) -> bool:
        return len({self.hosts[rank] for rank in dist.get_process_group_ranks(group)}) > 1

    def collectives(self) -> list[dict[str, Any]]:
        """Each group of size > 1 (TP, CP, DP, EP, PP; every rank runs its own group's collectives at once), then the
        world's broadcast from rank 0. Per collective: bus bandwidth in GB/s by NCCL's tests' definitions (all-reduce
        ``bytes / s x 2 (n - 1) / n``, all-gather and all-to-all ``x (n - 1) / n``, broadcast ``x 1``), the group,
        its size, and whether it spans nodes. Every rank returns the same collectives in the same order."""
        nbytes = COLLECTIVE_BYTES[self.device.type]
        send = torch.ones(nbytes // 4, dtype=torch.float32, device=self.device)
        results = []
        for name, group in self._groups().items():
            if dist.get_world_size(group) > 1:
                results += self._group_collectives(name, group, send)
        world = dist.group.WORLD
        if dist.get_world_size() > 1:
            seconds = self._best_seconds(lambda: dist.broadcast(send, src=0))
            results.append(self._entry("world", "broadcast", dist.get_world_size(), world, nbytes / seconds / 1e9))
        return results

    def _group_collectives(self, name: str, group: Any, send: torch.Tensor) -> list[dict[str, Any]]:
        """All-reduce, all-gather and all-to-all of ``send`` over ``group`` (this rank's group ``name``)."""
        size, nbytes = dist.get_world_size(group), send.numel() * send.element_size()
        gathered = torch.empty(size * send.numel(), dtype=send.dtype, device=self.device)
        exchanged = torch.empty_like(send)
        timed = {  # the action, and its bus bytes per byte sent (NCCL's tests' factors)
            "all-reduce": (lambda: dist.all_reduce(send, group=group), 2 * (size - 1) / size),
            "all-gather": (lambda: dist.all_gather_into_tensor(gathered, send, group=group), size - 1),
            "all-to-all": (lambda: dist.all_to_all_single(exchanged, send, group=group), (size - 1) / size),
        }
        return [
            self._entry(name, collective, size, group, nbytes * factor / self._best_seconds(action) / 1e9)
            for collective, (action, factor) in timed.items()
        ]

    def _entry(self, group: str, collective: str, size: int, handle: Any, gbps: float) -> dict[str, Any]:
        return {
            "group": group,
            "collective": collective,
            "size": size,
            "spans_nodes": self._spans_nodes(handle),
            "bus_gbps": gbps,
            "where": self.where(),
        }

    def close(self) -> None:
        """Leave the process groups."""
        from megatron_rl.parallel.distributed import destroy_parallel

        destroy_parallel()
