"""Trained weights into the rollout engines: streaming Megatron -> Hugging Face export, buckets, transports.

Imports ``models`` and ``parallel`` (the exporter) and ``rollout``'s engine
interface and protocol (what the transports call); never Ray.
"""

from megatron_rl.weight_sync.buckets import iter_buckets
from megatron_rl.weight_sync.syncer import SyncStats, WeightSyncer, build_syncer, build_transport
from megatron_rl.weight_sync.transports import DiskTransport, DistributedTransport, TensorTransport, WeightTransport

__all__ = [
    "DiskTransport",
    "DistributedTransport",
    "SyncStats",
    "TensorTransport",
    "WeightSyncer",
    "WeightTransport",
    "build_syncer",
    "build_transport",
    "iter_buckets",
]
