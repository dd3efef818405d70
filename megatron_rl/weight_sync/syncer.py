"""One weight sync: pause the engines, stream the export through buckets and a transport, resume.

Called on every trainer rank at once (it is collective: the exporter gathers
over TP groups and the ranks meet at barriers). Rank 0 is the controller. The
order, as slime and verl drive SGLang (read in their weight-update code) with
SGLang 0.5.23's weight-update session added where its ``weight_updater.py``
requires it:

1. controller: ``pause_generation(retract)`` (in-flight requests are held and
   will re-prefill with the new weights), ``begin_weight_update`` when the
   transport needs a session (tensor, distributed);
2. barrier; every rank streams its share of the export through the transport;
   barrier;
3. controller: ``end_weight_update`` (the engine post-processes the loaded weights: SGLang 0.5.23
   re-quantises block FP8 scales to UE8M0 there on Blackwell only, for DeepGEMM; on Hopper the FP8
   weights and ``weight_scale_inv`` stay as sent), ``flush_cache`` (plain-text answer; accepted while
   paused with retract; drops prefixes cached under the old weights), ``continue_generation``.
   One flush, after the update: nothing is prefilled while paused; none for SGLang on CPU,
   which keeps no prefix cache (its flush is a ``gc.collect()`` of about 0.5 s).

A sync that fails after step 1 closes the session on the controller (so a
retry can open one) and re-raises; generation stays paused, since the
engines hold partly updated weights.

The ``version`` string travels with every update request and comes back as
``meta_info.weight_version`` in generation results.

:func:`build_transport` is the one place a transport is chosen.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.config.hf_config import QwenArchitecture
from megatron_rl.config.schema import WeightSyncConfig
from megatron_rl.engines.engine import EngineError, RolloutEngine
from megatron_rl.models.weight_transfer import Allocate, export_full_model, export_hf_weights
from megatron_rl.weight_sync.buckets import MIB, BucketFiller, NamedTensor, tensor_bytes
from megatron_rl.weight_sync.fault_injection import dropped_tensor, without
from megatron_rl.weight_sync.transports import DiskTransport, DistributedTransport, TensorTransport, WeightTransport
from megatron_rl.wire.fp8_blocks import quantize_named

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncStats:
    """What this rank sent in one sync: tensors, bytes, buckets and wall seconds (pause to resume)."""

    num_tensors: int
    num_bytes: int
    num_buckets: int
    seconds: float


def _on_controller(engines: Sequence[RolloutEngine], action: Callable[[RolloutEngine], None]) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        for engine in engines:
            action(engine)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _open(engine: RolloutEngine, session: bool) -> None:
    engine.pause_generation("retract")
    if session:
        engine.begin_weight_update()


def _abandon(engine: RolloutEngine) -> None:
    """After a failed sync: close the session so a retry can open one; generation stays paused (the
    engine holds partly updated weights). A failure here is logged, not raised over the sync's own."""
    try:
        engine.end_weight_update()
    except EngineError as error:
        logger.warning("could not close the weight-update session of %s after a failed sync: %s", engine.name, error)


def _close(engine: RolloutEngine, session: bool, flush_cache: bool) -> None:
    if session:
        engine.end_weight_update()
    if flush_cache:
        engine.flush_cache()
    engine.continue_generation()


class WeightSyncer:
    """Streams named tensors into ``engines`` through ``transport`` in buckets of ``bucket_bytes``.

    ``flush_cache``: flush each engine's prefix cache after an update; False only for engines that keep
    none (SGLang on CPU, ``--disable-radix-cache``), where nothing cached could outlive the old weights.
    ``fp8_block``: the engines serve blockwise FP8 weights of that block (FP8 rollouts): every
    projection is quantised on this rank's device as it is exported and sent as its FP8 weight and
    scales (:func:`~megatron_rl.wire.fp8_blocks.quantize_named`), through any transport.
    """

    def __init__(
        self,
        engines: Sequence[RolloutEngine],
        transport: WeightTransport,
        *,
        bucket_bytes: int,
        flush_cache: bool = True,
        fp8_block: tuple[int, int] | None = None,
    ) -> None:
        self.engines = list(engines)
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self.flush_cache = flush_cache
        self.fp8_block = fp8_block

    def sync(self, named_tensors: Iterable[NamedTensor], version: str) -> SyncStats:
        """Deliver this rank's share of the weights; every rank calls it with its own stream."""
        return self.sync_export(lambda allocate: named_tensors, version)

    def sync_export(self, export: Callable[[Allocate | None], Iterable[NamedTensor]], version: str) -> SyncStats:
        """Deliver the stream ``export(allocate)``, where ``allocate`` hands out bucket memory (or is None).

        ``export`` may write its tensors into memory ``allocate`` hands out (the tensor
        transport's shared buffers: the bucket is then sent without a copy), on the condition
        :class:`~megatron_rl.weight_sync.buckets.BucketFiller` states: it yields every tensor it
        allocated before it allocates the next (``export_hf_weights`` does).
        """
        start = time.perf_counter()
        session = self.transport.needs_session
        _on_controller(self.engines, lambda e: _open(e, session))
        counts = [0, 0, 0]

        def send(bucket: list[NamedTensor]) -> None:
            self.transport.send_bucket(bucket, version)
            counts[0] += len(bucket)
            counts[1] += sum(tensor_bytes(t) for _, t in bucket)
            counts[2] += 1

        try:
            filler = BucketFiller(self.bucket_bytes, send, self.transport.allocate)
            _barrier()
            self.transport.begin(version)
            if self.transport.feeds:
                # A quantised weight is a new tensor, so the export does not write into bucket memory then; nor when
                # a planted fault drops one (the filler expects every tensor it allocated).
                dropped = dropped_tensor()
                stream: Iterable[NamedTensor]
                if self.fp8_block is not None:
                    stream = quantize_named(export(None), self.fp8_block)
                elif dropped is not None:
                    stream = export(None)
                else:
                    stream = export(filler.allocate)
                if dropped is not None:
                    stream = without(stream, dropped)
                for name, tensor in stream:
                    filler.add(name, tensor)
                filler.flush()
            else:
                for _ in export(None):  # its collectives, with the ranks that send
                    pass
            self.transport.finish(version)
            _barrier()
        except BaseException:
            self.transport.settle()
            if session:
                _on_controller(self.engines, _abandon)
            raise
        _on_controller(self.engines, lambda e: _close(e, session, self.flush_cache))
        num_tensors, num_bytes, num_buckets = counts
        return SyncStats(num_tensors, num_bytes, num_buckets, time.perf_counter() - start)

    def sync_megatron(self, chunks: Sequence[torch.nn.Module], arch: QwenArchitecture, version: str) -> SyncStats:
        """Sync this rank's Megatron chunks, written by the export straight into the transport's bucket memory
        where it has some: the whole model from every rank when the transport feeds each engine rank from one
        trainer rank (:attr:`~megatron_rl.weight_sync.transports.WeightTransport.exports_full_model`), else each
        tensor once, by its designated source rank."""
        if self.transport.exports_full_model:
            experts = self.transport.experts_fed(arch.num_experts)
            return self.sync_export(
                lambda allocate: export_full_model(chunks, arch, allocate=allocate, experts=experts), version
            )
        return self.sync_export(
            lambda allocate: export_hf_weights(chunks, arch, designated_only=True, allocate=allocate), version
        )

    def close(self) -> None:
        """Release the transport's resources (e.g. broadcast groups)."""
        self.transport.close()


def build_transport(
    config: WeightSyncConfig,
    placement: str,
    engines: Sequence[RolloutEngine],
    *,
    engine_world_sizes: Sequence[int] | None = None,
    engine_ep_size: int = 1,
    master_address: str | None = None,
    disk_dir: str | Path | None = None,
    hf_config_dir: str | Path | None = None,
) -> WeightTransport:
    """The transport ``config.transport`` names (``auto``: tensor when colocated, distributed otherwise).

    ``engine_ep_size``: each engine's expert-parallel size (the tensor transport feeds an engine rank only
    its experts). ``master_address``: this rank's node IP as the engines' nodes reach it (the distributed
    transport hosts its broadcast group there). Raises ValueError for ``distributed`` without
    ``master_address`` and for ``disk`` without ``disk_dir`` and ``hf_config_dir``.
    """
    kind = config.resolved(placement)
    if kind == "tensor":
        return TensorTransport(engines, engine_world_sizes, engine_ep_size=engine_ep_size)
    if kind == "distributed":
        if master_address is None:
            raise ValueError(
                "weight_sync.transport=distributed needs master_address: the sending rank's node IP, "
                "reachable from every engine's node"
            )
        return DistributedTransport(engines, engine_world_sizes, master_address=master_address)
    if disk_dir is None or hf_config_dir is None:
        raise ValueError("weight_sync.transport=disk needs disk_dir (shared by trainer and engines) and hf_config_dir")
    return DiskTransport(engines, disk_dir, hf_config_dir)


def build_syncer(
    config: WeightSyncConfig,
    placement: str,
    engines: Sequence[RolloutEngine],
    *,
    flush_cache: bool = True,
    fp8_block: tuple[int, int] | None = None,
    **kwargs: Any,
) -> WeightSyncer:
    """A :class:`WeightSyncer` with the transport of :func:`build_transport` and the recipe's bucket size."""
    transport = build_transport(config, placement, engines, **kwargs)
    bucket_bytes = config.bucket_size_mb * MIB
    return WeightSyncer(engines, transport, bucket_bytes=bucket_bytes, flush_cache=flush_cache, fp8_block=fp8_block)
