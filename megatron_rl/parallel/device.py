"""The one CPU-or-GPU decision of a process, and what follows from it.

:func:`on_accelerator` is the only place that asks torch whether a GPU is present; every
other choice (the device, the process-group backend, the Transformer Engine spec, pinned
host memory, the CPU compatibility layer) derives from it. A recipe's own choice,
``cluster.gpus_per_node == 0`` (a CPU recipe), decides placement in the driver; inside a
trainer or engine process the device it was given decides. Imports torch only.
"""

from __future__ import annotations

import importlib.util
import os

import torch


def on_accelerator() -> bool:
    """True when this process sees a CUDA device."""
    return torch.cuda.is_available()


def transformer_engine_usable() -> bool:
    """True when a CUDA device is present and Transformer Engine is importable."""
    return on_accelerator() and importlib.util.find_spec("transformer_engine") is not None


def collective_backend() -> str:
    """``nccl`` on a GPU, ``gloo`` on CPU."""
    return "nccl" if on_accelerator() else "gloo"


def select_device() -> torch.device:
    """This process's device: its GPU when CUDA is available, else the CPU.

    Under torchrun every process sees all of the node's GPUs and takes ``cuda:LOCAL_RANK``. Under
    Ray a trainer actor sees only the GPU it was given (``CUDA_VISIBLE_DEVICES`` names one id),
    so it takes ``cuda:0`` whatever its ``LOCAL_RANK``. Raises RuntimeError when the process sees
    several GPUs but fewer than ``LOCAL_RANK + 1``.
    """
    if not on_accelerator():
        return torch.device("cpu")
    local_rank, visible = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if visible == 1:
        return torch.device("cuda", 0)
    if local_rank >= visible:
        raise RuntimeError(
            f"LOCAL_RANK={local_rank} but this process sees {visible} GPUs "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); give each rank one GPU "
            "or all of the node's"
        )
    return torch.device("cuda", local_rank)
