"""CUDA IPC tensor payloads as torch writes them, made without a GPU (for serializer and protocol tests)."""

from __future__ import annotations

import base64
import pickle

import torch
from torch.multiprocessing import reductions


def cuda_rebuild_args(device: int | str) -> tuple:
    """Arguments as torch's ``reduce_tensor`` gives ``rebuild_cuda_tensor`` for a [2, 3] fp32 tensor on ``device``."""
    size, stride = torch.Size([2, 3]), (3, 1)
    storage = (torch.storage.TypedStorage, torch.float32, device, b"h" * 64, 24, 0)
    return (torch.Tensor, size, stride, 0, *storage, False, b"r" * 16, 0, b"e" * 64, True)


class _CudaReduction:
    """Pickles as the reduction ``(rebuild_cuda_tensor, args)``."""

    def __init__(self, args: tuple) -> None:
        self.args = args

    def __reduce__(self) -> tuple:
        return reductions.rebuild_cuda_tensor, self.args


def cuda_payload(name: str, args: tuple) -> str:
    """Base64 payload of ``[(name, CUDA tensor)]`` whose rebuild gets ``args``, as ``serialize_named_tensors`` writes it."""
    return base64.b64encode(pickle.dumps([(name, _CudaReduction(args))], pickle.HIGHEST_PROTOCOL)).decode()
