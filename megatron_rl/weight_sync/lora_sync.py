"""Adapter-only weight sync for LoRA runs: the engines keep their base weights and load each version's adapter.

Called on every trainer rank at once with the whole adapter under PEFT names (each rank holds all of it,
``PolicyActor.export_adapter()``). The order is the full sync's (:mod:`~megatron_rl.weight_sync.syncer`) on
SGLang 0.5.23's LoRA endpoints, which need no weight-update session (``docs/lora-sync.md`` cites the source):

1. controller (rank 0): ``pause_generation(retract)`` on every engine;
2. barrier; the adapter is loaded into every engine as ``policy-v{version}``
   (:func:`~megatron_rl.engines.protocol.lora_adapter_name`), by :class:`TensorDelivery` or :class:`DiskDelivery`;
   every rank learns whether any failed (a failure raises on all of them, generation stays paused);
3. controller: ``update_weight_version(version)`` (SGLang's LoRA loads set no version; without it generation
   would go on reporting the last full sync's), ``flush_cache`` when asked, ``continue_generation``, then
   ``unload_lora_adapter`` of the engine's previous adapter.

A new name per version, and the old one unloaded only after ``continue``: SGLang's unload removes the name at
once but returns only when no request holding that adapter is left (``lora_registry.wait_for_unload``), and
requests held by a ``retract`` pause cannot end before ``continue``, so an unload inside the pause would never
return (and would hold SGLang's ``lora_update_lock``, blocking every later load). A request held across a sync
ends with the adapter it named. Loading a name an engine already holds is taken as done (SGLang answers "already
loaded"): a version's adapter never changes, so a retry after a failed sync, or a resync after an engine restart,
finds the engines that have it as they should be.
"""

from __future__ import annotations

import abc
import json
import logging
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megatron_rl.config.schema import WeightSyncConfig
from megatron_rl.config.sglang_pin import LORA_NOT_BY_BROADCAST
from megatron_rl.engines.engine import EngineError, EngineRequestError
from megatron_rl.engines.protocol import (
    LoadLoRAAdapterFromTensorsRequest,
    LoadLoRAAdapterRequest,
    LoRAUpdateResult,
    PauseMode,
    lora_adapter_name,
)
from megatron_rl.parallel.device import select_device
from megatron_rl.weight_sync.buckets import NamedTensor
from megatron_rl.weight_sync.engine_feeds import colocated_feeds, engine_feeders
from megatron_rl.weight_sync.syncer import SyncStats
from megatron_rl.wire.tensor_serialization import (
    FLATTENED_BUCKET,
    flattened_bucket,
    serialize_flattened_bucket,
    serialize_tensor_dict,
)

logger = logging.getLogger(__name__)

ALIGN_BYTES = 64
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class LoRAEngine(Protocol):
    """What an adapter sync asks of an engine (:class:`~megatron_rl.engines.http_engine.HttpEngine` has it all)."""

    name: str

    def pause_generation(self, mode: PauseMode = "retract") -> None: ...
    def continue_generation(self) -> None: ...
    def flush_cache(self) -> None: ...
    def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> None: ...
    def load_lora_adapter_from_tensors(self, request: LoadLoRAAdapterFromTensorsRequest) -> LoRAUpdateResult: ...
    def load_lora_adapter(self, request: LoadLoRAAdapterRequest) -> LoRAUpdateResult: ...
    def unload_lora_adapter(self, lora_name: str) -> LoRAUpdateResult: ...


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _already_loaded(error: EngineRequestError, name: str) -> bool:
    """Whether ``error`` is SGLang's refusal of a name the engine holds (``lora_manager.py:354-359``)."""
    try:
        answer = LoRAUpdateResult.from_json(json.loads(error.body))
    except (ValueError, KeyError, TypeError):
        return False
    return answer.error_message == f"Failed to load LoRA adapter {name} because it is already loaded"


def _load(engine: LoRAEngine, name: str, load: Callable[[LoRAEngine], LoRAUpdateResult]) -> None:
    """``load(engine)``, an engine that already holds ``name`` counting as loaded (module docstring)."""
    try:
        load(engine)
    except EngineRequestError as error:
        if not _already_loaded(error, name):
            raise
        logger.info("engine %s already holds adapter %s", engine.name, name)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def packed(adapter: Mapping[str, torch.Tensor], device: torch.device, dtype: torch.dtype | None) -> list[NamedTensor]:
    """The adapter's tensors (cast to ``dtype``; None: as they are) copied into one new ``uint8`` buffer on
    ``device`` (CPU: in shared memory), each at a 64-byte-aligned offset; views of it, in the adapter's order.

    A new buffer every sync: an engine may keep reading what it was sent for as long as it holds that adapter
    (SGLang on CPU keeps views of it), so nothing sent is ever written again."""
    dtypes = [tensor.dtype if dtype is None else dtype for tensor in adapter.values()]
    sizes = [_aligned(t.numel() * d.itemsize) for t, d in zip(adapter.values(), dtypes, strict=True)]
    buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    if device.type == "cpu":
        buffer.share_memory_()
    views, offset = [], 0
    for (name, tensor), tensor_dtype, size in zip(adapter.items(), dtypes, sizes, strict=True):
        nbytes = tensor.numel() * tensor_dtype.itemsize
        view = buffer[offset : offset + nbytes].view(tensor_dtype).view(tensor.shape)
        views.append((name, view.copy_(tensor.detach())))
        offset += size
    return views


def _agree(failure: BaseException | None) -> None:
    """Raise on every rank when any rank's part of the delivery failed (collective): its own failure on that rank,
    an EngineError naming the first one elsewhere."""
    if not dist.is_initialized():
        if failure is not None:
            raise failure
        return
    texts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(texts, None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    failed = [(rank, text) for rank, text in enumerate(texts) if text is not None]
    if failed:
        rank, text = failed[0]
        raise EngineError(f"the adapter sync failed on trainer rank {rank}: {text}")


class AdapterDelivery(abc.ABC):
    """How one sync's adapter reaches every engine: a rank's part, called on every rank with the whole adapter."""

    dtype: torch.dtype | None = None
    """The dtype the adapter goes in (the engines'); None: as exported."""

    def wire_bytes(self, adapter: Mapping[str, torch.Tensor]) -> int:
        """The adapter's bytes as delivered (in :attr:`dtype`)."""
        return sum(t.numel() * (self.dtype or t.dtype).itemsize for t in adapter.values())

    @abc.abstractmethod
    def deliver(self, adapter: Mapping[str, torch.Tensor], name: str, config: dict[str, Any]) -> None:
        """Load ``adapter`` (PEFT names) with PEFT ``config`` as ``name``; returns once this rank's engines hold it."""

    def retire(self, name: str) -> None:  # noqa: B027 (optional hook)
        """On the controller, after every engine unloaded ``name``: drop what was kept for it."""


class TensorDelivery(AdapterDelivery):
    """``/load_lora_adapter_from_tensors``: engine rank ``t`` of engine ``e`` is fed by the trainer rank on its device
    (:func:`~megatron_rl.weight_sync.engine_feeds.colocated_feeds`), which copies the adapter into one buffer on
    that device (CPU: shared memory; GPU: a CUDA IPC handle named by UUID) and serializes it once, for that rank,
    as SGLang's ``flattened_bucket`` (one handle; ``srt/managers/tp_worker.py:217-230``). An engine's feeders
    gather their payloads (gloo) to the feeder of its TP rank 0, which posts one request with them in TP-rank
    order (SGLang hands ``serialized_named_tensors[tp_rank]`` to each rank, which slices its shard itself).
    The feeders keep their buffers until the post has returned (a barrier of the engine's feeders).

    ``dtype``: the engines' dtype, sent instead of the adapter's own (SGLang casts into it when it fills its
    LoRA memory pool; the same rounding here halves an fp32 adapter's bytes); None: as exported.
    """

    def __init__(
        self,
        engines: Sequence[LoRAEngine],
        engine_tp_sizes: Sequence[int] | None = None,
        *,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.engines = list(engines)
        self.engine_tp_sizes = list(engine_tp_sizes or [1] * len(self.engines))
        self.dtype = dtype
        self._world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.feed = colocated_feeds(self._world_size, self.engine_tp_sizes)[_rank()]
        self._group: dist.ProcessGroup | None = None
        self._groups_made = False

    def _make_feeder_groups(self) -> None:
        """One gloo group per engine fed by several ranks (collective over the default group, in engine order)."""
        self._groups_made = True
        for feeders in engine_feeders(self._world_size, self.engine_tp_sizes):
            if len(feeders) > 1:
                group = dist.new_group(list(feeders), backend="gloo")
                if isinstance(group, dist.ProcessGroup) and self.feed is not None and self.feed.feeders == feeders:
                    self._group = group

    def deliver(self, adapter: Mapping[str, torch.Tensor], name: str, config: dict[str, Any]) -> None:
        if not self._groups_made and dist.is_initialized():
            self._make_feeder_groups()
        if self.feed is None:
            return
        views = packed(adapter, select_device(), self.dtype)
        flat = flattened_bucket(views)
        payload = serialize_tensor_dict(dict(views)) if flat is None else serialize_flattened_bucket(*flat)
        payloads: list[str | None] = [payload]
        if self._group is not None:
            payloads = [None] * len(self.feed.feeders)
            dist.all_gather_object(payloads, payload, group=self._group)
        load_format = None if flat is None else FLATTENED_BUCKET
        request = LoadLoRAAdapterFromTensorsRequest(name, config, [p for p in payloads if p], load_format=load_format)
        try:
            if self.feed.posts:
                _load(self.engines[self.feed.engine], name, lambda e: e.load_lora_adapter_from_tensors(request))
        finally:  # ``views`` lives to here: every feeder's buffer stays until the engine has opened it
            if self._group is not None:
                dist.barrier(group=self._group)


class DiskDelivery(AdapterDelivery):
    """``/load_lora_adapter``: rank 0 writes the PEFT directory ``<directory>/<name>/`` (``adapter_config.json``,
    ``adapter_model.safetensors``, cast to ``dtype`` as :class:`TensorDelivery`) on a filesystem the engines read,
    then every engine loads it (concurrently). One directory per version: SGLang reads an unloaded adapter again
    from its directory when a request names it (``tokenizer_manager.py:3760-3786``), so a name must keep its
    contents; a directory goes when its adapter is unloaded (:meth:`retire`)."""

    def __init__(self, engines: Sequence[LoRAEngine], directory: str | Path, *, dtype: torch.dtype | None = None):
        self.engines = list(engines)
        self.directory = Path(directory)
        self.dtype = dtype

    def deliver(self, adapter: Mapping[str, torch.Tensor], name: str, config: dict[str, Any]) -> None:
        if _rank() != 0:
            return
        path = self.directory / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        tensors = {key: t.detach().to("cpu", self.dtype or t.dtype).contiguous() for key, t in adapter.items()}
        save_file(tensors, path / ADAPTER_WEIGHTS)
        (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
        request = LoadLoRAAdapterRequest(name, str(path))
        with ThreadPoolExecutor(max_workers=max(1, len(self.engines)), thread_name_prefix="lora-disk") as pool:
            loads = [
                pool.submit(_load, e, name, lambda target: target.load_lora_adapter(request)) for e in self.engines
            ]
            for load in loads:
                load.result()

    def retire(self, name: str) -> None:
        shutil.rmtree(self.directory / name, ignore_errors=True)


class LoRASyncer:
    """Loads the policy's adapter into ``engines`` through ``delivery`` each sync (module docstring).

    ``adapter_config``: the PEFT ``adapter_config.json`` sent with every adapter
    (:func:`~megatron_rl.models.lora_peft.peft_adapter_config`). ``flush_cache``: flush each engine's prefix cache
    in the pause, as a full sync does (False for engines that keep none). The controller remembers each engine's
    adapter to unload it after the next sync; :meth:`engines_replaced` forgets those of restarted engines.
    """

    def __init__(
        self,
        engines: Sequence[LoRAEngine],
        delivery: AdapterDelivery,
        adapter_config: dict[str, Any],
        *,
        flush_cache: bool = True,
    ) -> None:
        self.engines = list(engines)
        self.delivery = delivery
        self.adapter_config = adapter_config
        self.flush_cache = flush_cache
        self._held: dict[int, str] = {}

    @property
    def controller(self) -> bool:
        """Whether this rank drives the engines' pause, version and unloads (rank 0)."""
        return _rank() == 0

    def sync(self, adapter: Mapping[str, torch.Tensor], version: str) -> SyncStats:
        """Deliver ``adapter`` (PEFT names, the whole adapter on every rank) as weight version ``version``; collective.
        Raises on every rank when any part failed, generation left paused."""
        start = time.perf_counter()
        name = lora_adapter_name(version)
        if self.controller:
            for engine in self.engines:
                engine.pause_generation("retract")
        _barrier()
        failure: BaseException | None = None
        try:
            self.delivery.deliver(adapter, name, self.adapter_config)
        except Exception as error:  # every rank must reach the agreement, or the others would wait for it
            failure = error
        _agree(failure)
        if self.controller:
            self._resume(name, version)
        return SyncStats(len(adapter), self.delivery.wire_bytes(adapter), 1, time.perf_counter() - start)

    def _resume(self, name: str, version: str) -> None:
        """Report ``version``, flush, continue; then unload each engine's previous adapter (it returns once the
        requests that named it have ended)."""
        for engine in self.engines:
            engine.update_weight_version(version, abort_all_requests=False)
            if self.flush_cache:
                engine.flush_cache()
            engine.continue_generation()
        unloaded = set()
        for index, engine in enumerate(self.engines):
            previous, self._held[index] = self._held.get(index), name
            if previous is None or previous == name:
                continue
            try:
                engine.unload_lora_adapter(previous)
            except EngineRequestError as error:  # the engine lost it (restarted unannounced): nothing to free
                logger.warning("engine %s could not unload adapter %s: %s", engine.name, previous, error)
            unloaded.add(previous)
        for retired in unloaded - set(self._held.values()):
            self.delivery.retire(retired)

    def engines_replaced(self, indices: Sequence[int]) -> None:
        """Engines ``indices`` run in new processes, holding no adapter (between syncs)."""
        for index in indices:
            self._held.pop(index, None)


def lora_delivery_kind(config: WeightSyncConfig, placement: str) -> str:
    """``tensor`` or ``disk``: ``weight_sync.transport`` for an adapter, ``auto`` as tensor when colocated and disk
    when disaggregated (the adapter needs no broadcast group: SGLang 0.5.23 loads adapters from tensors or a
    directory only). Raises ValueError for ``distributed``."""
    if config.transport == "auto":
        return "tensor" if placement == "colocated" else "disk"
    if config.transport == "distributed":
        raise ValueError(
            f"weight_sync.transport=distributed with lora: {LORA_NOT_BY_BROADCAST}; set weight_sync.transport to "
            "tensor (engines on the trainer ranks' nodes), disk (a filesystem every node shares) or auto"
        )
    return config.transport


def build_lora_syncer(
    config: WeightSyncConfig,
    placement: str,
    engines: Sequence[LoRAEngine],
    adapter_config: dict[str, Any],
    *,
    flush_cache: bool = True,
    engine_tp_sizes: Sequence[int] | None = None,
    disk_dir: str | Path | None = None,
    dtype: torch.dtype | None = None,
) -> LoRASyncer:
    """A :class:`LoRASyncer` with the delivery :func:`lora_delivery_kind` names. ``engine_tp_sizes``: each
    engine's TP ranks (tensor delivery); ``disk_dir``: where the disk delivery writes its directories (shared by
    trainer and engines); ``dtype``: the engines' dtype, the adapter's dtype on the wire. Raises ValueError as
    :func:`lora_delivery_kind`, and for disk without ``disk_dir``."""
    if lora_delivery_kind(config, placement) == "tensor":
        delivery: AdapterDelivery = TensorDelivery(engines, engine_tp_sizes, dtype=dtype)
    elif disk_dir is None:
        raise ValueError("an adapter sync through disk needs disk_dir (a directory trainer and engines share)")
    else:
        delivery = DiskDelivery(engines, disk_dir, dtype=dtype)
    return LoRASyncer(engines, delivery, adapter_config, flush_cache=flush_cache)
