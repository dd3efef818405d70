"""The one CPU-or-GPU decision of a process, and what follows from it.

:func:`on_accelerator` is the only place that asks torch whether a GPU is present; every
other choice (the device, the process-group backend, the Transformer Engine spec, pinned
host memory, the CPU compatibility layer) derives from it. Transformer Engine counts as usable only
when ``transformer_engine.pytorch`` imports (:func:`transformer_engine_problem` says why not). A recipe's own choice,
``cluster.gpus_per_node == 0`` (a CPU recipe), decides placement in the driver; inside a
trainer or engine process the device it was given decides. Imports torch (and, on a GPU, Transformer Engine).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
import warnings

import torch

TRANSFORMER_ENGINE_INSTALL_HINT = "./launch/setup.sh --gpu builds TE 2.20.2 against this venv's torch"
"""What a process that cannot use Transformer Engine is told to run."""


def on_accelerator() -> bool:
    """True when this process sees a CUDA device."""
    return torch.cuda.is_available()


GPU_ARCH_OF_MAJOR: dict[int, str] = {9: "hopper", 10: "blackwell"}
"""The ``cluster.gpu_arch`` of a compute capability's major version: H100/H200 are 9.0, B200/GB200 10.0."""


def gpu_arch_mismatch(declared: str, capability: tuple[int, int], device_name: str) -> str | None:
    """Why ``cluster.gpu_arch`` = ``declared`` misdescribes a GPU of compute ``capability`` named ``device_name``,
    or None: it describes it, or the GPU is neither Hopper nor Blackwell (the field names no other)."""
    detected = GPU_ARCH_OF_MAJOR.get(capability[0])
    if detected is None or detected == declared:
        return None
    major, minor = capability
    return (
        f"cluster.gpu_arch is {declared!r}, but this GPU is {device_name} (compute capability {major}.{minor}: "
        f"{detected}); validate decides with cluster.gpu_arch which FP8 recipes and FP8 rollouts can run here "
        f"(mxfp8 needs blackwell, FP8 rollouts hopper), so set cluster.gpu_arch={detected}"
    )


def check_gpu_arch(declared: str) -> None:
    """Raise ValueError (:func:`gpu_arch_mismatch`) when this process's GPU is not of the ``declared``
    ``cluster.gpu_arch``; nothing without a GPU (``validate`` may run on a login node, so only a rank can tell)."""
    if not on_accelerator():
        return
    mismatch = gpu_arch_mismatch(declared, torch.cuda.get_device_capability(), torch.cuda.get_device_name())
    if mismatch is not None:
        raise ValueError(mismatch)


def transformer_engine_usable() -> bool:
    """True when a CUDA device is present and ``transformer_engine.pytorch`` imports.

    :func:`transformer_engine_problem` says why not when it is False.
    """
    return transformer_engine_problem() is None


def transformer_engine_problem() -> str | None:
    """Why Transformer Engine is not usable in this process, or None when it is.

    Usable means a CUDA device and an importable ``transformer_engine.pytorch``: that import loads TE's
    compiled PyTorch extension and its CUDA core, so a build against another torch or CUDA fails here, with
    its import error, rather than deep inside Megatron. A GPU process whose TE is installed but does not
    import also gets a RuntimeWarning: it then runs without TE (Megatron's local layers, no FP8).
    """
    if not on_accelerator():
        return "this process sees no CUDA device"
    return _transformer_engine_import_problem()


@functools.cache
def _transformer_engine_import_problem() -> str | None:
    """Imports ``transformer_engine.pytorch`` once per process; the reason it failed, or None."""
    if importlib.util.find_spec("transformer_engine") is None:
        return f"transformer_engine is not installed in {sys.prefix} ({TRANSFORMER_ENGINE_INSTALL_HINT})"
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as error:  # ImportError, OSError (a missing .so), RuntimeError (TE's own checks), ...
        problem = (
            f"transformer_engine is installed but `import transformer_engine.pytorch` fails: "
            f"{type(error).__name__}: {error} (a build against another torch or CUDA? {TRANSFORMER_ENGINE_INSTALL_HINT})"
        )
        warnings.warn(problem, RuntimeWarning, stacklevel=3)
        return problem
    return None


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
