"""SGLang 0.5.23 on a machine without a GPU: the engine process's environment (flags: ``sglang_pin.CPU_FLAGS``).

SGLang serves on CPU through its torch-native paths (attention, MoE, norms, top-k) once
``SGLANG_USE_CPU_ENGINE=1`` is set (without it SGLang imports ``vllm``) and ``sgl_kernel`` can be
imported. ``sgl_kernel``'s shared objects link the NVIDIA driver library, ``libcuda.so.1``, so on a
machine without a driver they do not load; :func:`driver_standin_dir` builds a stand-in from
``native/libcuda_standin.c`` (every entry point answers "no device") and the engine process finds
it through ``LD_LIBRARY_PATH``. Only CPU engine processes get it; :func:`cpu_engine_environment`
refuses on a machine where torch sees a GPU, so the stand-in never shadows a real driver.

SGLang's LoRA code pins host memory unconditionally, which torch cannot do without a GPU; the engine's
``PYTHONPATH`` is led by :data:`SITE_DIR`, whose ``sitecustomize`` makes pinning a no-op there (that module
says where and why).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_rl.config.sglang_pin import CPU_ENGINE_ENV

STANDIN_SOURCE = Path(__file__).with_name("native") / "libcuda_standin.c"
STANDIN_LIBRARY = "libcuda.so.1"
SITE_DIR = Path(__file__).with_name("native") / "cpu_site"
"""Holds the ``sitecustomize`` that makes pinned host memory a no-op in a CPU engine's processes."""


def default_build_root() -> Path:
    """Where stand-ins are built: ``<sys.prefix>/lib/megatron-rl`` (the virtual environment that runs SGLang)."""
    return Path(sys.prefix) / "lib" / "megatron-rl"


def driver_standin_dir(build_root: Path | None = None) -> Path:
    """A directory holding ``libcuda.so.1`` built from :data:`STANDIN_SOURCE`; built with ``gcc`` on first use.

    The directory is named by the source's hash, so an edited source builds anew; concurrent
    callers each build into a temporary directory and one rename wins. Raises RuntimeError naming
    the fix when no C compiler is found or the build fails.
    """
    source = STANDIN_SOURCE.read_bytes()
    target = (build_root or default_build_root()) / f"libcuda-standin-{hashlib.sha256(source).hexdigest()[:16]}"
    if (target / STANDIN_LIBRARY).is_file():
        return target
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        raise RuntimeError(
            "SGLang on CPU needs a C compiler to build its libcuda.so.1 stand-in (gcc not found): "
            "install gcc (Debian: apt-get install gcc) or set CC"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    command = [compiler, "-O2", "-shared", "-fPIC", "-Wl,-soname," + STANDIN_LIBRARY, "-o",
               str(staging / STANDIN_LIBRARY), str(STANDIN_SOURCE)]  # fmt: skip
    built = subprocess.run(command, capture_output=True, text=True)
    if built.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(f"building the libcuda.so.1 stand-in failed ({' '.join(command)}):\n{built.stderr}")
    try:
        staging.rename(target)
    except OSError:  # another process renamed its build there first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def cpu_engine_environment() -> dict[str, str]:
    """The variables a CPU SGLang engine process needs beyond this process's environment.

    ``SGLANG_USE_CPU_ENGINE=1``, ``LD_LIBRARY_PATH`` led by the stand-in's directory and ``PYTHONPATH`` led by
    :data:`SITE_DIR` (each keeps what this process has after it). Raises
    RuntimeError when torch sees a GPU here: a GPU machine runs SGLang on its GPUs, with the real driver.
    """
    import torch  # here, not at the top: the CLI and every spawned reward worker import this module

    if torch.cuda.is_available():
        raise RuntimeError(
            "a CPU SGLang engine was asked for on a machine with a GPU; set cluster.gpus_per_node to the GPUs "
            "per node so the engine runs on them"
        )
    return {
        CPU_ENGINE_ENV: "1",
        "LD_LIBRARY_PATH": _led_by(str(driver_standin_dir()), "LD_LIBRARY_PATH"),
        "PYTHONPATH": _led_by(str(SITE_DIR), "PYTHONPATH"),
    }


def _led_by(first: str, variable: str) -> str:
    """``first``, then the entries of this process's ``variable`` (a ``:``-separated path list)."""
    inherited = [path for path in os.environ.get(variable, "").split(":") if path]
    return ":".join([first, *inherited])
