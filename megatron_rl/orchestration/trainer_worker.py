"""One trainer rank as the driver sees it: a :class:`PolicyActor` plus weight sync and checkpoint parts.

A :class:`~megatron_rl.orchestration.worker_group.RankWorkerGroup` builds one
:class:`TrainerWorker` per rank (with the torchrun environment set) and calls each
method on every rank at once; collectives inside need all of them
(:class:`~megatron_rl.orchestration.trainer_group.TrainerGroup` is the driver's typed view).
A rank receives only its data-parallel shard of a step and returns scalars.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import ray
import torch.distributed as dist

from megatron_rl.actor.step_data import StepData
from megatron_rl.config.hf_config import load_hf_config
from megatron_rl.config.schema import LoRAConfig, RunConfig
from megatron_rl.engines import HttpEngine
from megatron_rl.orchestration.engine_host import EngineAddress
from megatron_rl.orchestration.network import RunNetwork
from megatron_rl.parallel.device import check_gpu_arch

# Megatron-side modules are imported by the methods that run on a rank: the driver imports this class only to start
# ranks and name their methods, and megatron-core costs it 3 s of start-up (benchmarks/startup.py).
if TYPE_CHECKING:
    from megatron_rl.actor.policy_actor import PolicyActor
    from megatron_rl.weight_sync.lora_sync import LoRASyncer
    from megatron_rl.weight_sync.syncer import WeightSyncer


@dataclass(frozen=True)
class ShardReceipt:
    """What one trainer rank received for a step: its global rank, the step positions of its samples, bytes."""

    rank: int
    sample_ids: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class RankPaths:
    """The folders a trainer rank reads and writes, absolute: a rank on another node has a working directory of
    its own, so a path relative to the driver's would name another folder there.

    ``hf_dir``: the Hugging Face checkpoint the actor starts from (config.json + safetensors);
    ``weight_sync_dir``: where the disk transport writes the engines' weights (a filesystem every node shares);
    ``engine_config_dir``: the engines' config.json (FP8 rollouts: their checkpoint's, with its quantization).
    Raises ValueError for a relative path.
    """

    hf_dir: str
    weight_sync_dir: str
    engine_config_dir: str

    def __post_init__(self) -> None:
        relative = {name: path for name, path in vars(self).items() if not Path(path).is_absolute()}
        if relative:
            raise ValueError(f"RankPaths takes absolute paths (RankPaths.of resolves them), not {relative}")

    @classmethod
    def of(cls, cfg: RunConfig, hf_dir: Path) -> RankPaths:
        """``hf_dir`` and ``cfg``'s folders resolved against this process's working directory (the driver's)."""
        return cls(
            hf_dir=str(hf_dir.resolve()),
            weight_sync_dir=str(Path(cfg.run_dir, "weight_sync").resolve()),
            engine_config_dir=str(Path(cfg.rollout_fp8_dir or hf_dir).resolve()),
        )


class TrainerWorker:
    """This rank's actor, built from the Hugging Face checkpoint ``paths.hf_dir`` (every rank loads the same weights).

    Args:
        cfg: the run's recipe.
        paths: the folders the rank reads and writes, absolute (:meth:`RankPaths.of`).
        api_key: the run's engine key, sent with every request to the engines.

    Raises ValueError, before anything is built, when the rank's GPU is not of ``cluster.gpu_arch``
    (:func:`~megatron_rl.parallel.device.check_gpu_arch`).

    The rank learns where the rollout engines are from :meth:`connect_engines`, so it can be built
    while they start; weight sync needs that call first. Weight sync over broadcast groups hosts each
    sending rank's group on that rank's address in the run's network
    (:class:`~megatron_rl.orchestration.network.RunNetwork`: 127.0.0.1 on one node, the recipe's
    interface on this node otherwise), where engines on other nodes join it.
    """

    def __init__(self, cfg: RunConfig, paths: RankPaths, api_key: str | None = None) -> None:
        from megatron.core import parallel_state

        from megatron_rl.actor.policy_actor import PolicyActor, parallel_sizes
        from megatron_rl.parallel.distributed import initialize_parallel

        check_gpu_arch(cfg.cluster.gpu_arch)  # validate's FP8 checks trusted it, on a machine that may have no GPU
        initialize_parallel(parallel_sizes(cfg.parallel), seed=cfg.train.seed)
        self.actor: PolicyActor = PolicyActor(
            load_hf_config(paths.hf_dir),
            cfg.parallel,
            cfg.train,
            cfg.algorithm,
            norm_constant=cfg.loss_norm_constant,
            temperature=cfg.rollout.temperature,
            hf_weights=paths.hf_dir,
            lora=cfg.lora,
            lora_seed=cfg.train.seed,
        )
        self._cfg, self._paths, self._api_key = cfg, paths, api_key
        self._clients: list[HttpEngine] = []
        self._weight_syncer: WeightSyncer | None = None
        self._lora_syncer: LoRASyncer | None = None
        self._rank = dist.get_rank()
        self._dp_rank: int = parallel_state.get_data_parallel_rank()

    def connect_engines(self, engines: Sequence[EngineAddress]) -> None:
        """Weight sync delivers to the engines at ``engines`` (name, host, port), in engine order: the whole model,
        or with ``lora:`` the adapter alone."""
        from megatron_rl.weight_sync.syncer import build_syncer

        cfg = self._cfg
        self._clients = [HttpEngine(name, host, port, api_key=self._api_key) for name, host, port in engines]
        if cfg.lora is not None:
            self._lora_syncer = self._build_lora_syncer(cfg.lora)
            return
        self._weight_syncer = build_syncer(
            cfg.weight_sync,
            cfg.rollout.placement,
            self._clients,
            flush_cache=not cfg.sglang_on_cpu,  # SGLang's CPU engines keep no prefix cache (sglang_pin.CPU_FLAGS)
            fp8_block=cfg.rollout.fp8_block if cfg.rollout.quantization == "fp8" else None,
            engine_world_sizes=[cfg.engine_tp_ranks] * len(self._clients),
            engine_ep_size=cfg.rollout.ep,
            master_address=RunNetwork.of_run(cfg).address(ray.util.get_node_ip_address()),
            disk_dir=self._paths.weight_sync_dir,
            hf_config_dir=self._paths.engine_config_dir,
        )

    def _build_lora_syncer(self, lora: LoRAConfig) -> LoRASyncer:
        import torch

        from megatron_rl.models.lora_peft import peft_adapter_config
        from megatron_rl.weight_sync.lora_sync import build_lora_syncer

        cfg = self._cfg
        return build_lora_syncer(
            cfg.weight_sync,
            cfg.rollout.placement,
            self._clients,
            peft_adapter_config(lora),
            flush_cache=not cfg.sglang_on_cpu,  # as the full sync's
            engine_tp_sizes=[cfg.engine_tp_ranks] * len(self._clients),
            disk_dir=self._paths.weight_sync_dir,
            # "auto": the adapter travels in float32 (as the trainer exports it) and the engine casts it
            dtype=None if cfg.rollout.dtype == "auto" else getattr(torch, cfg.rollout.dtype),
        )

    @property
    def _syncer(self) -> WeightSyncer:
        if self._weight_syncer is None:
            raise RuntimeError("weight sync needs TrainerWorker.connect_engines first")
        return self._weight_syncer

    def data_parallel_rank(self) -> int:
        """This rank's data-parallel rank: which shard of a step it trains on."""
        return self._dp_rank

    def train_step(self, shard: StepData) -> tuple[dict[str, float], ShardReceipt]:
        """The step on this rank's shard (:func:`~megatron_rl.actor.train_step.train_step` on the actor); its
        metrics and a receipt.

        The metrics are the same on every rank; the receipt says what this rank received.
        """
        from megatron_rl.actor.train_step import train_step

        receipt = ShardReceipt(self._rank, tuple(shard.sample_ids.tolist()), shard.nbytes())
        return train_step(self.actor, shard), receipt

    def offload(self, keep_params: bool = False) -> None:
        """Move this rank's actor state to host memory while colocated engines use the device (bit-exact).

        ``keep_params``: only gradients and optimizer state; the parameters stay for a weight sync.
        """
        self.actor.offload(keep_params=keep_params)

    def reload(self) -> None:
        """Bring back what :meth:`offload` moved, bit for bit."""
        self.actor.reload()

    def device_memory(self) -> dict[str, int]:
        """This rank's GPU bytes: ``allocated`` now and ``peak`` since the rank started (torch's caching allocator);
        empty on CPU, where nothing is measured."""
        import torch

        if not torch.cuda.is_available():
            return {}
        return {"allocated": torch.cuda.memory_allocated(), "peak": torch.cuda.max_memory_allocated()}

    def sync_weights(self, version: int) -> float:
        """Deliver the current weights (with ``lora:``, the adapter) to every engine as ``version``; seconds it took
        on this rank."""
        if self._lora_syncer is not None:
            return self._lora_syncer.sync(self.actor.export_adapter(), str(version)).seconds
        return self._syncer.sync_megatron(self.actor.chunks, self.actor.arch, str(version)).seconds

    def engines_restarted(self, addresses: dict[int, EngineAddress]) -> None:
        """Engines run again (new processes) at ``addresses`` (by engine index): later syncs go there, from a
        fresh start."""
        for index, (_, host, port) in addresses.items():
            self._clients[index].rebind(host, port)
        if self._lora_syncer is not None:
            self._lora_syncer.engines_replaced(list(addresses))
            return
        self._syncer.transport.engines_replaced(addresses.keys())

    def save_checkpoint(self, directory: str) -> None:
        """Write model, optimizer and schedule shards and this rank's RNG states into ``directory``."""
        from megatron_rl.checkpoint.rank_state import save_rank_state

        optimizer = self.actor.optimizer
        save_rank_state(self.actor.chunks, optimizer.optimizer, optimizer.scheduler, directory)

    def export_hf(self, directory: str) -> None:
        """Write the current weights as a Hugging Face model directory ``directory`` (all ranks together).

        Weights in the dtype the starting checkpoint's config.json names (as ``convert mcore-to-hf``
        writes them), with its config, generation config and tokenizer files; complete on return.
        With LoRA: the adapters merged in, and the adapter alone in ``adapter/`` (PEFT files).
        """
        from megatron_rl.models.hf_export import write_hf_model_dir

        write_hf_model_dir(self.actor.chunks, self.actor.arch, self._paths.hf_dir, directory, lora=self.actor.lora)

    def load_checkpoint(self, directory: str, *, reseed: int | None = None) -> None:
        """Restore what :meth:`save_checkpoint` wrote, from this or any other layout.

        ``reseed``: the layout differs, so generators are seeded from it instead of restored
        (:func:`~megatron_rl.checkpoint.rank_state.load_rank_state`).
        """
        from megatron_rl.checkpoint.rank_state import load_rank_state

        optimizer = self.actor.optimizer
        load_rank_state(self.actor.chunks, optimizer.optimizer, optimizer.scheduler, directory, reseed=reseed)

    def close(self) -> None:
        """Release the weight-sync transport (when engines were connected) and tear down the process groups."""
        from megatron_rl.parallel.distributed import destroy_parallel

        if self._weight_syncer is not None:
            self._weight_syncer.close()
        destroy_parallel()
