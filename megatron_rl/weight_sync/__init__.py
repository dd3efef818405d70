"""Trained weights into the rollout engines: streaming Megatron -> Hugging Face export, buckets, transports.

``syncer`` (export in buckets), ``buckets`` (filling them), ``bucket_buffers`` (the tensor
transport's shared-memory bucket memory, which the export writes into) and ``transports`` (one
class per way of delivering a bucket) import ``models`` and ``parallel`` and call ``rollout``'s
engine interface; never Ray. The
wire modules, ``tensor_serialization`` (the ``update_weights_from_tensor`` payload) and
``weight_group`` (the broadcast group of ``update_weights_from_distributed``), and ``fp8_blocks``
(FP8 rollouts' blockwise quantisation) import torch only: they are both sides of the wire, so the
reference engine receives with the same code.
This package's ``__init__`` imports nothing, so an engine that imports a wire module does not
load Megatron.
"""
