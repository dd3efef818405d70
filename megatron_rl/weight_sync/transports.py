"""How a trainer rank's buckets reach the engines: one class per transport behind :class:`WeightTransport`.

Every trainer rank owns one transport and calls ``begin``, ``send_bucket``
for each of its buckets (possibly none), and ``finish``, all with the sync's
weight version; ``begin``/``finish`` are collective over the trainer's
default process group when the transport needs it (disk, distributed). Each
sending rank talks to the engines directly; nothing is funnelled through one
rank. ``needs_session``: the transport's updates must run inside the engines'
weight-update session (SGLang 0.5.23: tensor and distributed updates), which
the syncer's controller opens and closes.

- :class:`TensorTransport` (colocated): ``/update_weights_from_tensor`` with
  IPC handles (a CUDA device named by UUID). It hands out bucket memory
  (:attr:`WeightTransport.allocate`): two reused shared-memory buffers per rank,
  filled in turn, which the exporter writes its full tensors into (the TP gather's
  concatenation, the layout conversion), so a CPU trainer's bucket goes as views with
  no pack; other CPU tensors in private memory are copied into the same buffers (one
  copy, the model's storage untouched), CUDA tensors into two such buffers on their
  device. A bucket in one buffer goes as SGLang's ``flattened_bucket`` (one handle
  and per-tensor metadata); CPU tensors already in shared memory go as they are, one
  handle each (the engine's copy into its weights is then the only copy). One bucket
  is in flight while the next is exported. CUDA IPC handles open only on
  the sender's node: the recipe check refuses colocated engines on nodes without the
  sending rank.
- :class:`DistributedTransport` (disaggregated): this rank is rank 0 of its own
  broadcast group with every engine rank (engine ``i`` at rank offset
  1 + sum of the previous engines' sizes); per bucket it posts
  ``/update_weights_from_distributed`` to every engine and broadcasts the bucket:
  on GPU with ``load_format="flattened_bucket"``, its tensors packed back to back
  as one buffer (:mod:`~megatron_rl.weight_sync.dense_buckets`; a bucket whose
  dtypes would misalign that layout goes as several such requests), on CPU one
  broadcast per tensor (``DistributedTransport.flatten``). Gloo on CPU, NCCL on
  GPU; the group is created on the first bucket and kept until :meth:`close`. Joining a group and each bucket's
  requests + broadcasts run under the one :class:`~megatron_rl.weight_sync.send_lock.SendLock`
  of all trainer ranks, so several sending ranks never deadlock engines that
  serve one weight request at a time.
- :class:`DiskTransport`: each rank writes its buckets as safetensors shards
  into a shared directory; after a barrier, rank 0 copies the config files and
  posts ``/update_weights_from_disk`` (no session: SGLang loads and
  post-processes a disk update by itself).
"""

from __future__ import annotations

import abc
import logging
import shutil
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megatron_rl.models.weight_transfer import Allocate
from megatron_rl.parallel.device import collective_backend
from megatron_rl.parallel.stores import listen_socket
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.protocol import (
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
)
from megatron_rl.weight_sync.bucket_buffers import BucketBuffers
from megatron_rl.weight_sync.buckets import NamedTensor
from megatron_rl.weight_sync.dense_buckets import aligned_runs, pack
from megatron_rl.weight_sync.send_lock import SendLock, create_send_lock
from megatron_rl.weight_sync.tensor_serialization import (
    FLATTENED_BUCKET,
    flattened_bucket,
    serialize_flattened_bucket,
    serialize_named_tensors,
)
from megatron_rl.weight_sync.weight_group import (
    WeightGroup,
    broadcast_from_trainer,
    create_weight_group,
    destroy_weight_group,
)

logger = logging.getLogger(__name__)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _engine_threads(engines: Sequence[RolloutEngine], name: str) -> ThreadPoolExecutor:
    """Threads a transport keeps for its calls to ``engines``: an HTTP engine keeps a connection per
    thread, so kept threads reuse theirs (a pool made per bucket started a thread and opened a
    connection per engine every time: 1.7 against 1.0 ms a bucket on the 2-core box)."""
    return ThreadPoolExecutor(max_workers=max(1, len(engines)), thread_name_prefix=name)


def _on_every_engine(
    engines: Sequence[RolloutEngine], call: Callable[[int, RolloutEngine], None], pool: ThreadPoolExecutor
) -> None:
    """Run ``call(index, engine)`` for all engines concurrently in ``pool`` (the transport's
    :func:`_engine_threads`); re-raise the first failure."""
    for future in [pool.submit(call, i, engine) for i, engine in enumerate(engines)]:
        future.result()


def _in_shared_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a CPU tensor in shared memory, which an engine opens where it is."""
    return tensor.device.type == "cpu" and tensor.untyped_storage().is_shared()


class WeightTransport(abc.ABC):
    """Delivers this rank's buckets of (Hugging Face name, full tensor) to every engine."""

    needs_session: bool = True
    """Whether updates must run between the engines' ``begin_weight_update`` and ``end_weight_update``."""

    @property
    def allocate(self) -> Allocate | None:
        """Memory of the bucket being filled, for the caller to write a tensor into and send in it; None: none."""
        return None

    def begin(self, version: str) -> None:  # noqa: B027 (optional hook)
        """Start a sync (collective for transports that need it)."""

    @abc.abstractmethod
    def send_bucket(self, bucket: list[NamedTensor], version: str) -> None:
        """Deliver one bucket; returns once every engine holds it (disk: once it is written)."""

    def finish(self, version: str) -> None:  # noqa: B027 (optional hook)
        """End a sync (collective for transports that need it)."""

    def settle(self) -> None:  # noqa: B027 (optional hook)
        """After a failed sync: return once nothing this rank sent is still in flight (errors are logged)."""

    def engines_replaced(self, indices: Collection[int]) -> None:  # noqa: B027 (optional hook)
        """Engines ``indices`` now run in new processes: forget what was shared with the old ones (between syncs)."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release resources held across syncs."""


class TensorTransport(WeightTransport):
    """Colocated engines: IPC handles through ``/update_weights_from_tensor``, one bucket in flight.

    ``engine_tp_sizes[i]`` payloads go to engine ``i``, one serialization per TP rank
    (the same memory; each rank opens its own payload, so each releases the reference
    its serialization took, as SGLang's own client does). CUDA tensors name their
    device by UUID, so an engine numbering the node's GPUs differently opens the right one.

    Pipelined: :meth:`send_bucket` posts its bucket from a background thread and returns;
    the caller prepares (gathers, converts) bucket k+1 while the engines load bucket k. The
    next :meth:`send_bucket` and :meth:`finish` wait for the bucket in flight (re-raising its
    failure), so the engines receive buckets in order, one at a time, and every bucket is
    loaded when :meth:`finish` returns. Bucket memory (:attr:`allocate`) comes from two reused
    shared-memory buffers filled in turn (:class:`~megatron_rl.weight_sync.bucket_buffers.BucketBuffers`,
    each at most 2 x the largest bucket): bucket k+1 is written into the buffer bucket k-1 was
    sent from, which :meth:`send_bucket` of bucket k waited for, so writing bucket k+1 never
    touches memory the engines are reading; a bucket that lacks a tensor allocated for it is
    refused (RuntimeError), since that tensor's buffer is reused next. CPU tensors in private
    memory are copied into that memory when sent, and CUDA tensors into two such buffers on their
    device (a device copy, released when the sync finishes, so a colocated trainer's offload frees
    them). CPU tensors already in shared memory (``storage.is_shared()``, e.g. weights moved there
    once with ``share_memory_()``) are sent as they are, views of the sender's storage, kept alive
    until loaded: the engines read the sender's memory directly, so the caller must not write such
    a tensor before :meth:`finish` returns (a trainer does not: the sync runs between optimizer
    steps). A CPU storage shared by file descriptor is moved to a named shared-memory file on its
    first send (by torch, once).

    A bucket whose tensors all lie in one buffer goes as SGLang's ``flattened_bucket``: one IPC
    handle and per-tensor metadata, instead of one handle per tensor, which cost about 72 us a
    tensor on an H200 (a Qwen3-30B-A3B sync sends about 19,000 tensors); any other bucket goes
    tensor by tensor.
    """

    NUM_BUFFERS = 2

    def __init__(self, engines: Sequence[RolloutEngine], engine_tp_sizes: Sequence[int] | None = None) -> None:
        self.engines = list(engines)
        self.engine_tp_sizes = list(engine_tp_sizes or [1] * len(self.engines))
        self._buffers = BucketBuffers(self.NUM_BUFFERS)
        self._device_buffers: dict[torch.device, BucketBuffers] = {}
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync-tensor")
        self._engine_calls = _engine_threads(self.engines, "weight-sync-engine")
        self._in_flight: Future[None] | None = None

    @property
    def allocate(self) -> Allocate:
        return self._buffers.allocate

    def _buffers_for(self, tensor: torch.Tensor) -> BucketBuffers:
        if not tensor.is_cuda:
            return self._buffers
        if tensor.device not in self._device_buffers:
            self._device_buffers[tensor.device] = BucketBuffers(self.NUM_BUFFERS, tensor.device)
        return self._device_buffers[tensor.device]

    def _shareable(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as the engines can open it: as it is in shared memory, else copied into a buffer."""
        if _in_shared_memory(tensor):
            return tensor
        return self._buffers_for(tensor).copy_in(tensor)

    def _post(self, shared: list[NamedTensor], version: str) -> None:
        flat = flattened_bucket(shared)
        load_format = None if flat is None else FLATTENED_BUCKET

        def serialize() -> str:
            return serialize_named_tensors(shared) if flat is None else serialize_flattened_bucket(*flat)

        def update(index: int, engine: RolloutEngine) -> None:
            payloads = [serialize() for _ in range(self.engine_tp_sizes[index])]
            request = UpdateWeightsFromTensorRequest(
                payloads, load_format=load_format, flush_cache=False, weight_version=version
            )
            engine.update_weights_from_tensor(request)

        _on_every_engine(self.engines, update, self._engine_calls)

    def _wait(self) -> None:
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.result()

    def begin(self, version: str) -> None:
        """Nothing is in flight between syncs: the next bucket fills its buffer from the start."""
        self._buffers.restart()

    def send_bucket(self, bucket: list[NamedTensor], version: str) -> None:
        shared = [(name, self._shareable(tensor)) for name, tensor in bucket]
        for buffers in (self._buffers, *self._device_buffers.values()):
            buffers.seal(shared)
        self._wait()
        self._in_flight = self._sender.submit(self._post, shared, version)

    def finish(self, version: str) -> None:
        self._wait()
        self._release_device_buffers()

    def _release_device_buffers(self) -> None:
        for buffers in self._device_buffers.values():
            buffers.release()

    def settle(self) -> None:
        try:
            self._wait()
        except Exception as error:  # the sync's own failure is what the caller raises
            logger.warning("a weight bucket in flight also failed: %s", error)
        self._release_device_buffers()

    def close(self) -> None:
        try:
            self._wait()
        finally:
            self._sender.shutdown(wait=True)
            self._engine_calls.shutdown(wait=True)
            self._buffers.release()
            self._device_buffers = {}


class DistributedTransport(WeightTransport):
    """Disaggregated engines: a broadcast group per sending rank (see the module docstring).

    ``master_address``: the address engines reach this rank's node by; the group's store is
    hosted there, listening on that address only (the default 127.0.0.1 serves engines on
    this node only).

    ``flatten``: send each bucket packed into one buffer (SGLang's ``flattened_bucket``: one
    request and broadcast per aligned run) or one broadcast per tensor. Default: packed for CUDA
    buckets (NCCL: one collective instead of thousands, and the packing is a device copy),
    tensor by tensor for CPU ones (gloo: measured on the 2-core box, a TP2 x EP2 sync of 0.77 GB
    took 0.93-1.26 s tensor by tensor and 1.26-1.29 s packed, the packing copy unhidden).
    """

    def __init__(
        self,
        engines: Sequence[RolloutEngine],
        engine_world_sizes: Sequence[int] | None = None,
        *,
        master_address: str = "127.0.0.1",
        backend: str | None = None,
        timeout_s: float = 300.0,
        flatten: bool | None = None,
    ) -> None:
        self.engines = list(engines)
        self.engine_world_sizes = list(engine_world_sizes or [1] * len(self.engines))
        self.master_address = master_address
        self.flatten = flatten
        self.backend = backend or collective_backend()
        self.timeout_s = timeout_s
        self.group_name = f"megatron_rl_weights_rank{_rank()}"
        self._group: WeightGroup | None = None
        self._lock: SendLock | None = None
        self._posts = _engine_threads(self.engines, "weight-sync-post")

    def begin(self, version: str) -> None:
        """First sync: every trainer rank joins the send lock (collective over the default group)."""
        if self._lock is None:
            self._lock = create_send_lock(self.master_address)

    def _ensure_group(self) -> WeightGroup:
        if self._group is not None:
            return self._group
        listener = listen_socket(self.master_address)
        port = listener.getsockname()[1]
        world_size = 1 + sum(self.engine_world_sizes)
        offsets = [1 + sum(self.engine_world_sizes[:i]) for i in range(len(self.engines))]
        requests = [
            InitWeightsUpdateGroupRequest(self.master_address, port, offset, world_size, self.group_name, self.backend)
            for offset in offsets
        ]
        joins = [
            self._posts.submit(e.init_weights_update_group, r) for e, r in zip(self.engines, requests, strict=True)
        ]
        self._group = create_weight_group(
            self.master_address,
            port,
            0,
            world_size,
            self.group_name,
            self.backend,
            timeout_s=self.timeout_s,
            listener=listener,
        )
        for join in joins:
            join.result()
        return self._group

    def send_bucket(self, bucket: list[NamedTensor], version: str) -> None:
        if self._lock is None:
            raise RuntimeError("DistributedTransport.send_bucket before begin(): the send lock is not set up")
        with self._lock.holding():
            self._send(bucket, version)

    def _send(self, bucket: list[NamedTensor], version: str) -> None:
        """Flattened: each aligned run of the bucket as one request and one broadcast of its dense bytes;
        else the bucket as one request and a broadcast per tensor (see ``flatten``)."""
        group = self._ensure_group()
        flatten = self.flatten if self.flatten is not None else any(t.is_cuda for _, t in bucket)
        for run in aligned_runs(bucket) if flatten else [bucket]:
            request = UpdateWeightsFromDistributedRequest(
                names=[name for name, _ in run],
                dtypes=[str(t.dtype).removeprefix("torch.") for _, t in run],
                shapes=[list(t.shape) for _, t in run],
                group_name=self.group_name,
                flush_cache=False,
                weight_version=version,
                load_format=FLATTENED_BUCKET if flatten else None,
            )
            payload = [pack(run)] if flatten else [t.contiguous() for _, t in run]
            posts = [self._posts.submit(engine.update_weights_from_distributed, request) for engine in self.engines]
            for tensor in payload:
                broadcast_from_trainer(group, tensor)
            for post in posts:
                post.result()

    def engines_replaced(self, indices: Collection[int]) -> None:
        """The broadcast group included the old processes of engines ``indices``: the other engines leave it,
        this rank destroys its end, and the next sync builds a new group with the new processes."""
        if self._group is not None:
            others = [engine for i, engine in enumerate(self.engines) if i not in indices]
            _on_every_engine(others, lambda i, e: e.destroy_weights_update_group(self.group_name), self._posts)
            destroy_weight_group(self._group)
            self._group = None

    def close(self) -> None:
        try:
            if self._group is not None:
                _on_every_engine(
                    self.engines, lambda i, e: e.destroy_weights_update_group(self.group_name), self._posts
                )
                destroy_weight_group(self._group)
                self._group = None
        finally:
            self._posts.shutdown(wait=True)


class DiskTransport(WeightTransport):
    """Safetensors shards in ``directory`` (shared by all ranks and engines), then ``/update_weights_from_disk``."""

    CONFIG_FILES = ("config.json", "generation_config.json")
    needs_session = False

    def __init__(self, engines: Sequence[RolloutEngine], directory: str | Path, hf_config_dir: str | Path) -> None:
        self.engines = list(engines)
        self.directory = Path(directory)
        self.hf_config_dir = Path(hf_config_dir)
        self._shards = 0
        self._engine_calls = _engine_threads(self.engines, "weight-sync-disk")

    def begin(self, version: str) -> None:
        if _rank() == 0:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory.mkdir(parents=True)
        self._shards = 0
        _barrier()

    def send_bucket(self, bucket: list[NamedTensor], version: str) -> None:
        tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in bucket}
        save_file(tensors, self.directory / f"rank{_rank():05d}-{self._shards:05d}.safetensors")
        self._shards += 1

    def finish(self, version: str) -> None:
        _barrier()
        if _rank() == 0:
            for name in self.CONFIG_FILES:
                if (self.hf_config_dir / name).exists():
                    shutil.copy(self.hf_config_dir / name, self.directory / name)
            request = UpdateWeightsFromDiskRequest(str(self.directory), weight_version=version, flush_cache=False)
            _on_every_engine(self.engines, lambda i, e: e.update_weights_from_disk(request), self._engine_calls)
        _barrier()

    def close(self) -> None:
        self._engine_calls.shutdown(wait=True)
