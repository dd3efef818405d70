"""Trained weights into the rollout engines: streaming Megatron -> Hugging Face export, buckets, transports.

``syncer`` (export in buckets), ``buckets`` (filling them), ``bucket_buffers`` (the tensor
transport's shared-memory bucket memory, which the export writes into) and ``transports`` (one
class per way of delivering a bucket) import ``models`` and ``parallel``; ``lora_sync`` delivers a
LoRA run's adapter alone (a new name per version, ``docs/lora-sync.md``). They call the engine
interface of :mod:`megatron_rl.engines` and write the wire formats of :mod:`megatron_rl.wire`,
which the engines read with the same code; never Ray.
"""
