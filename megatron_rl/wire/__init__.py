"""The wire formats of a weight update, beneath both its sides (trainer ranks and engine processes).

``tensor_serialization`` (the ``update_weights_from_tensor`` payload), ``weight_group`` (the
broadcast group of ``update_weights_from_distributed``), ``dense_buckets`` (the flattened bucket
layout) and ``fp8_blocks`` (FP8 rollouts' blockwise quantisation) import torch and
:mod:`megatron_rl.parallel.stores` only, so an engine process that imports them loads no Megatron.
This package's ``__init__`` imports nothing.
"""
