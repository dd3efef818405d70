"""Pinned host memory as a no-op in the processes of a CPU SGLang engine (``sglang_cpu.cpu_engine_environment``).

SGLang 0.5.23's LoRA code pins its host-side tensors unconditionally: the LoRA layers' output offsets
(``srt/lora/layers.py:145,324,479,594,723,814``, built when ``--enable-lora`` wraps the model at start-up) and
each batch's segment tables (``srt/lora/backend/torch_backend.py:225-244``), although SGLang's own CPU platform
reports no pinned memory (``srt/platforms/cpu.py:121``). torch pins through the accelerator's host allocator,
which raises "Found no NVIDIA driver" where there is no GPU. Pinning only speeds host-to-device copies, and a
CPU engine has no device: so in a process where torch sees no GPU, ``Tensor.pin_memory()`` returns the tensor
itself and torch's factory functions ignore ``pin_memory=True``. Values, dtypes and devices are unchanged.

Python imports ``sitecustomize`` at start-up from ``PYTHONPATH`` (SGLang's scheduler processes inherit it).
The patch is applied when the process itself first imports torch, so nothing here changes import order or
runs in a process that never imports torch. Standard library only until then.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

FACTORIES = (
    "tensor", "empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full",
    "full_like", "arange",
)  # fmt: skip
"""torch's factory functions whose ``pin_memory=True`` is dropped (each raises without a GPU otherwise)."""


def _unpinned(factory: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(factory)
    def call(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return call


def _pinned_as_is(tensor: Any, device: Any = None) -> Any:
    """``Tensor.pin_memory``: the tensor itself (nothing to pin for)."""
    return tensor


def patch_torch(torch: ModuleType) -> bool:
    """Make pinning a no-op in ``torch`` unless it sees a GPU; whether it patched."""
    if torch.cuda.is_available():
        return False
    for name in FACTORIES:
        setattr(torch, name, _unpinned(getattr(torch, name)))
    torch.Tensor.pin_memory = _pinned_as_is
    return True


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Loads ``torch`` with its own loader, then :func:`patch_torch`; leaves ``sys.meta_path`` on first use."""

    def __init__(self) -> None:
        self._loader: importlib.abc.Loader | None = None

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        self._loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        assert self._loader is not None, "find_spec set it"
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        assert self._loader is not None, "find_spec set it"
        module.__loader__ = self._loader  # torch sees its own loader, as without this hook
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        patch_torch(module)


if "torch" in sys.modules:
    patch_torch(sys.modules["torch"])
else:
    sys.meta_path.insert(0, _PatchOnImport())
