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
  IPC handles (a CUDA device named by UUID), each engine rank fed by the trainer
  rank on its own device with the whole model (every node syncs its own engines).
  It hands out bucket memory (:attr:`WeightTransport.allocate`): two reused
  shared-memory buffers per rank, filled in turn, which the exporter writes its full
  tensors into, so a CPU trainer's bucket goes as views with no pack; other CPU
  tensors in private memory are copied into the same buffers, CUDA tensors into two
  such buffers on their device. A bucket in one buffer goes as SGLang's
  ``flattened_bucket`` (one handle and per-tensor metadata). One bucket is in flight
  while the next is exported.
- :class:`DistributedTransport` (disaggregated): this rank is rank 0 of its own
  broadcast group with every engine rank (engine ``i`` at rank offset
  1 + sum of the previous engines' sizes); per bucket it posts
  ``/update_weights_from_distributed`` to every engine and broadcasts the bucket:
  on GPU with ``load_format="flattened_bucket"``, its tensors packed back to back
  as one buffer (:mod:`~megatron_rl.wire.dense_buckets`; a bucket whose
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

from megatron_rl.engines.engine import EngineError, RolloutEngine
from megatron_rl.engines.protocol import (
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
)
from megatron_rl.models.weight_transfer import Allocate
from megatron_rl.parallel.device import collective_backend
from megatron_rl.parallel.stores import listen_socket
from megatron_rl.weight_sync.bucket_buffers import BucketBuffers
from megatron_rl.weight_sync.buckets import NamedTensor
from megatron_rl.weight_sync.engine_feeds import colocated_feeds, engine_feeders, engine_rank_experts
from megatron_rl.weight_sync.send_lock import SendLock, create_send_lock
from megatron_rl.wire.dense_buckets import aligned_runs, pack
from megatron_rl.wire.tensor_serialization import (
    FLATTENED_BUCKET,
    flattened_bucket,
    serialize_flattened_bucket,
    serialize_named_tensors,
)
from megatron_rl.wire.weight_group import (
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
    exports_full_model: bool = False
    """Whether every rank streams the whole model (:func:`~megatron_rl.models.weight_transfer.export_full_model`)
    instead of the tensors it is the designated source of."""

    @property
    def feeds(self) -> bool:
        """Whether this rank delivers buckets; a rank that does not still iterates the export (its collectives)."""
        return True

    @property
    def allocate(self) -> Allocate | None:
        """Memory of the bucket being filled, for the caller to write a tensor into and send in it; None: none."""
        return None

    def experts_fed(self, num_experts: int) -> range | None:
        """With :attr:`exports_full_model`, the global experts (of ``num_experts``) this rank's stream carries, the
        rest of the model whole; None: every expert."""
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
    """Colocated engines: each engine rank is fed IPC handles by the trainer rank on its own device.

    Every trainer rank exports the whole model (:attr:`exports_full_model`:
    :func:`~megatron_rl.models.weight_transfer.export_full_model`, the same buckets on every rank).
    The rank that shares a device with TP rank ``t`` of engine ``e``
    (:func:`~megatron_rl.weight_sync.engine_feeds.colocated_feeds`) serializes each bucket once, for
    that engine rank alone; the engine's feeders gather their payloads (gloo) to the feeder of TP
    rank 0, which posts one ``/update_weights_from_tensor`` per bucket to its engine with the
    payloads in TP-rank order (SGLang hands ``serialized_named_tensors[tp_rank]`` to each rank). So
    no engine process opens a handle of another GPU (which would cost it a CUDA context there), the
    weights never leave their node, and every node syncs its engines at once. Only the payloads
    (handles and metadata) of an engine spanning nodes cross nodes: its feeders sit on all of its
    nodes, so their gather crosses them, and SGLang's node 0 hands each node its TP ranks' payloads,
    handles of memory on that node. Ranks that feed no engine (CPU runs with fewer engines than
    ranks) take part in the export only. CUDA
    tensors name their device by UUID, so an engine numbering the node's GPUs differently opens
    the right one.

    Pipelined: a posting rank posts its bucket from a background thread and returns; the caller
    prepares bucket k+1 while the engine loads bucket k. Before the payloads of bucket k+1 are
    gathered, the poster waits for bucket k and hands its outcome to the other feeders with the
    gather, so every feeder returns from :meth:`send_bucket` of bucket k+1 only once bucket k is
    loaded, and all of them raise its failure. Bucket memory (:attr:`allocate`) comes from two
    reused shared-memory buffers filled in turn
    (:class:`~megatron_rl.weight_sync.bucket_buffers.BucketBuffers`, each at most 2 x the largest
    bucket): bucket k+1 is written into the buffer bucket k-1 was sent from, which is loaded by
    then, so writing never touches memory an engine reads; a bucket that lacks a tensor allocated
    for it is refused (RuntimeError), since that tensor's buffer is reused next. CPU tensors in
    private memory are copied into that memory when sent, and CUDA tensors into two such buffers
    on their device (a device copy, released when the sync finishes, so a colocated trainer's
    offload frees them). CPU tensors already in shared memory (``storage.is_shared()``) are sent as
    they are, views of the sender's storage: the caller must not write such a tensor before
    :meth:`finish` returns (a trainer does not: the sync runs between optimizer steps).

    An engine with expert parallelism (``engine_ep_size`` > 1) is fed by each rank only the experts
    its engine rank loads (:meth:`experts_fed`: SGLang's MoE weight loader drops the others), so a
    Qwen3-30B-A3B engine rank at TP 4 x EP 4 opens 5,043 tensors per sync instead of 18,867.

    A bucket whose tensors all lie in one buffer goes as SGLang's ``flattened_bucket``: one IPC
    handle and per-tensor metadata, instead of one handle per tensor, which cost about 72 us a
    tensor on an H200 (a Qwen3-30B-A3B sync sends about 19,000 tensors); any other bucket goes
    tensor by tensor.
    """

    NUM_BUFFERS = 2
    exports_full_model = True

    def __init__(
        self,
        engines: Sequence[RolloutEngine],
        engine_tp_sizes: Sequence[int] | None = None,
        *,
        engine_ep_size: int = 1,
    ) -> None:
        self.engines = list(engines)
        self.engine_tp_sizes = list(engine_tp_sizes or [1] * len(self.engines))
        self.engine_ep_size = engine_ep_size
        self._world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.feed = colocated_feeds(self._world_size, self.engine_tp_sizes)[_rank()]
        self._feeder_group: dist.ProcessGroup | None = None
        self._groups_made = False
        self._buffers = BucketBuffers(self.NUM_BUFFERS)
        self._device_buffers: dict[torch.device, BucketBuffers] = {}
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync-tensor")
        self._in_flight: Future[None] | None = None

    @property
    def feeds(self) -> bool:
        return self.feed is not None

    @property
    def allocate(self) -> Allocate | None:
        return self._buffers.allocate if self.feeds else None

    def experts_fed(self, num_experts: int) -> range | None:
        if self.feed is None or self.engine_ep_size == 1:
            return None
        tp_size = self.engine_tp_sizes[self.feed.engine]
        return engine_rank_experts(self.feed.tp_rank, tp_size, self.engine_ep_size, num_experts)

    def _buffers_for(self, tensor: torch.Tensor) -> BucketBuffers:
        if not tensor.is_cuda:
            return self._buffers
        if tensor.device not in self._device_buffers:
            self._device_buffers[tensor.device] = BucketBuffers(self.NUM_BUFFERS, tensor.device)
        return self._device_buffers[tensor.device]

    def _shareable(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as the engine can open it: as it is in shared memory, else copied into a buffer."""
        if _in_shared_memory(tensor):
            return tensor
        return self._buffers_for(tensor).copy_in(tensor)

    def _make_feeder_groups(self) -> None:
        """One gloo group per engine fed by several ranks (collective over the default group: every rank
        creates every group, in engine order)."""
        self._groups_made = True
        for feeders in engine_feeders(self._world_size, self.engine_tp_sizes):
            if len(feeders) > 1:
                group = dist.new_group(list(feeders), backend="gloo")
                if isinstance(group, dist.ProcessGroup) and self.feed is not None and self.feed.feeders == feeders:
                    self._feeder_group = group

    def _post(self, payloads: list[str], load_format: str | None, version: str) -> None:
        assert self.feed is not None
        request = UpdateWeightsFromTensorRequest(
            payloads, load_format=load_format, flush_cache=False, weight_version=version
        )
        self.engines[self.feed.engine].update_weights_from_tensor(request)

    def _outcome_of_in_flight(self) -> Exception | None:
        """Wait for the bucket in flight (posting rank); its failure, None when it loaded or there is none."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return None
        try:
            in_flight.result()
        except Exception as error:  # raised by _exchange, on every feeder of the engine
            return error
        return None

    def _exchange(self, mine: tuple[str, str | None] | None) -> list[tuple[str, str | None]]:
        """Share this feeder's (payload, load_format) with its engine's other feeders and learn how the bucket
        before it ended; the payloads in TP-rank order. Raises that bucket's failure (on the other feeders of a
        multi-rank engine as EngineError naming it)."""
        assert self.feed is not None
        failure = self._outcome_of_in_flight() if self.feed.posts else None
        if self._feeder_group is None:
            if failure is not None:
                raise failure
            return [] if mine is None else [mine]
        gathered: list[tuple[tuple[str, str | None] | None, str | None]] = [(None, None)] * len(self.feed.feeders)
        text = None if failure is None else f"{type(failure).__name__}: {failure}"
        dist.all_gather_object(gathered, (mine, text), group=self._feeder_group)
        if failure is not None:
            raise failure
        if gathered[0][1] is not None:
            raise EngineError(f"a weight bucket for engine {self.feed.engine} failed to load: {gathered[0][1]}")
        return [entry for entry, _ in gathered if entry is not None]

    def begin(self, version: str) -> None:
        """First sync: the feeder groups are made (collective). Nothing is in flight between syncs: the next
        bucket fills its buffer from the start."""
        if not self._groups_made and dist.is_initialized():
            self._make_feeder_groups()
        self._buffers.restart()

    def send_bucket(self, bucket: list[NamedTensor], version: str) -> None:
        if self.feed is None:
            raise RuntimeError(f"trainer rank {_rank()} feeds no engine; the syncer must not send it buckets")
        shared = [(name, self._shareable(tensor)) for name, tensor in bucket]
        for buffers in (self._buffers, *self._device_buffers.values()):
            buffers.seal(shared)
        flat = flattened_bucket(shared)
        payload = serialize_named_tensors(shared) if flat is None else serialize_flattened_bucket(*flat)
        entries = self._exchange((payload, None if flat is None else FLATTENED_BUCKET))
        if self.feed.posts:
            formats = {load_format for _, load_format in entries}
            if len(formats) != 1:
                raise RuntimeError(f"the feeders of engine {self.feed.engine} sent one bucket in formats {formats}")
            self._in_flight = self._sender.submit(self._post, [p for p, _ in entries], formats.pop(), version)

    def finish(self, version: str) -> None:
        """Every fed engine has loaded every bucket (collective over each engine's feeders)."""
        if self.feed is not None:
            self._exchange(None)
        self._release_device_buffers()

    def _release_device_buffers(self) -> None:
        for buffers in self._device_buffers.values():
            buffers.release()

    def settle(self) -> None:
        failure = self._outcome_of_in_flight()
        if failure is not None:  # the sync's own failure is what the caller raises
            logger.warning("a weight bucket in flight also failed: %s", failure)
        self._release_device_buffers()

    def close(self) -> None:
        try:
            failure = self._outcome_of_in_flight()
            if failure is not None:
                raise failure
        finally:
            self._sender.shutdown(wait=True)
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
