"""Preflight step ``install``: the interpreter, torch and CUDA, the pinned packages, and what the recipe imports.

Checked against the lock file ``./launch/setup.sh`` installs from (``launch/requirements.lock``, or
``launch/requirements-gpu.lock`` for a GPU recipe or a ``.venv`` given the GPU set); Transformer Engine's FP8
recipe class when the trainer runs in FP8; SGLang in the interpreter its engines run under when they are SGLang.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

import megatron_rl
from megatron_rl.config.schema import RunConfig, TrainConfig
from megatron_rl.config.sglang_env import INSTALL_HINT, SGLANG_PYTHON_ENV, sglang_python
from megatron_rl.config.sglang_pin import SGLANG_VERSION
from megatron_rl.parallel.device import TRANSFORMER_ENGINE_INSTALL_HINT
from megatron_rl.preflight.report import StepFailure, StepOutcome

ROOT = Path(megatron_rl.__file__).resolve().parents[1]
"""The checkout megatron-rl runs from; its ``launch/`` holds the lock files (absent for a wheel install)."""
CPU_LOCK, GPU_LOCK = ROOT / "launch" / "requirements.lock", ROOT / "launch" / "requirements-gpu.lock"
PINNED = ("torch", "megatron-core", "transformers", "ray", "safetensors", "pydantic")
"""The packages whose version the run's behaviour depends on, compared with the lock."""
SGLANG_IMPORT_TIMEOUT_S = 300.0
"""Importing sglang takes seconds to a minute (it imports torch and its kernels); past this it is hung."""
FP8_RECIPE_CLASSES = {
    "delayed": "DelayedScaling",
    "tensorwise": "Float8CurrentScaling",
    "blockwise": "Float8BlockScaling",
    "mxfp8": "MXFP8BlockScaling",
}
"""The ``transformer_engine.common.recipe`` class megatron-core 0.19.2 builds for each ``train.fp8_recipe``
(``fp8_utils.get_fp8_recipe``)."""


def installed_version(package: str) -> str | None:
    """The installed distribution's version, None when it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _normalized(name: str) -> str:
    """A distribution name as PEP 503 compares them: ``Transformer_Engine`` == ``transformer-engine``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, str]:
    """Normalized name -> pinned version of each ``name==version`` line of a lock file."""
    pins = {}
    for line in path.read_text().splitlines():
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            pins[_normalized(name)] = version.strip()
    return pins


def lock_file(cfg: RunConfig) -> Path:
    """The lock the run's ``.venv`` should match: the GPU set for a GPU recipe, or where ``setup.sh --gpu`` ran
    (it marks the venv; later runs keep that set), else the CPU set."""
    gpu_set = cfg.cluster.gpus_per_node > 0 or (Path(sys.prefix) / ".gpu-set").is_file()
    return GPU_LOCK if gpu_set else CPU_LOCK


def check_pins(lock: Path, packages: tuple[str, ...] = PINNED) -> dict[str, str]:
    """Installed version of each of ``packages``; StepFailure naming the package and both versions when one is
    absent or differs from ``lock``.

    A local label (``2.14.1+cu130``) matches its release, as pip's ``==`` does."""
    pins = read_lock(lock)
    setup = "./launch/setup.sh --gpu" if lock == GPU_LOCK else "./launch/setup.sh"
    found: dict[str, str] = {}
    for package in packages:
        version, pinned = installed_version(package), pins.get(_normalized(package))
        if version is None or (pinned is not None and version.split("+")[0] != pinned):
            raise StepFailure(
                f"{package} {version or 'is not installed'} in {sys.prefix}; {lock.name} pins {package}=={pinned}",
                f"run {setup} (installs {lock.relative_to(ROOT)}) and rerun from that .venv",
                {"installed": found | {package: version}},
            )
        found[package] = version
    return found


def check_devices(cfg: RunConfig) -> tuple[list[str], dict[str, object]]:
    """torch's version and CUDA build and, where CUDA is available, the GPUs this process sees and the driver.

    StepFailure naming ``cluster.gpus_per_node`` when the recipe has GPUs and this process sees fewer."""
    figures: dict[str, object] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
    lines = [f"torch {torch.__version__}, built for CUDA {torch.version.cuda or '- (a CPU build)'}"]
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible:
        figures |= {"cuda_devices": visible, "nvidia_driver": driver_version()}
        lines.append(
            f"{visible} CUDA devices ({torch.cuda.get_device_name(0)}), NVIDIA driver {figures['nvidia_driver']}"
        )
    if visible < cfg.cluster.gpus_per_node:
        raise StepFailure(
            f"the recipe runs on {cfg.cluster.gpus_per_node} GPUs per node and this process sees {visible} "
            f"(torch {torch.__version__}, CUDA {torch.version.cuda}, torch.cuda.is_available() "
            f"{torch.cuda.is_available()})",
            "cluster.gpus_per_node: run preflight on a node of the allocation with its GPUs visible "
            "(CUDA_VISIBLE_DEVICES), install a CUDA build of torch, or set the GPUs the nodes have (0: a CPU run)",
            figures,
        )
    if cfg.cluster.gpus_per_node == 0:
        lines.append("cluster.gpus_per_node is 0: a CPU run, no GPU needed")
    return lines, figures


def driver_version(proc: Path = Path("/proc/driver/nvidia/version")) -> str:
    """The loaded NVIDIA kernel driver's version, from ``proc`` or else ``nvidia-smi``; ``unknown`` when neither
    tells (torch reports only the CUDA runtime it was built with)."""
    if proc.is_file():
        match = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d[\d.]+)", proc.read_text())
        if match:
            return match[1]
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        result = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return result.stdout.splitlines()[0].strip() if result.stdout.strip() else "unknown"


def check_transformer_engine(train: TrainConfig) -> str:
    """With ``train.precision`` fp8: the installed Transformer Engine's version, once ``transformer_engine.pytorch``
    imports and holds the recipe's FP8 recipe class; StepFailure naming ``train.precision`` otherwise."""
    assert train.fp8_recipe is not None, "the recipe checks ask fp8 for a train.fp8_recipe"
    fix = f"{TRANSFORMER_ENGINE_INSTALL_HINT}; or set train.precision=bf16"
    try:
        importlib.import_module("transformer_engine.pytorch")  # loads TE's compiled extension and CUDA core
        recipes = importlib.import_module("transformer_engine.common.recipe")
    except Exception as error:  # ImportError, OSError (a missing .so), RuntimeError (TE's own checks)
        raise StepFailure(
            f"train.precision is fp8 and Transformer Engine does not import in {sys.prefix}: "
            f"{type(error).__name__}: {error}",
            fix,
        ) from error
    version = installed_version("transformer-engine") or "unknown"
    class_name = FP8_RECIPE_CLASSES[train.fp8_recipe]
    if not hasattr(recipes, class_name):
        raise StepFailure(
            f"train.fp8_recipe={train.fp8_recipe} needs transformer_engine.common.recipe.{class_name}; "
            f"Transformer Engine {version} has none",
            fix,
            {"transformer_engine": version},
        )
    return version


def check_sglang() -> tuple[str, str]:
    """(python, version) of the interpreter SGLang engines run under, once ``import sglang`` there reports
    :data:`~megatron_rl.config.sglang_pin.SGLANG_VERSION`; StepFailure otherwise (none found, the import fails or
    hangs, another version)."""
    python = sglang_python()
    fix = f"{INSTALL_HINT} (or set rollout.engine=reference)"
    if python is None:
        raise StepFailure("rollout.engine is sglang and no Python with sglang is found", fix)
    probe = [python, "-c", "import sglang; print(sglang.__version__)"]
    try:
        result = subprocess.run(probe, capture_output=True, text=True, timeout=SGLANG_IMPORT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise StepFailure(f"rollout.engine is sglang and {python} -c 'import sglang' fails: {error}", fix) from error
    version = result.stdout.strip().splitlines()[-1] if result.returncode == 0 and result.stdout.strip() else None
    if version is None:
        reason = (result.stderr.strip().splitlines() or ["no output"])[-1]
        where = f" (${SGLANG_PYTHON_ENV})" if os.environ.get(SGLANG_PYTHON_ENV) else ""
        raise StepFailure(f"rollout.engine is sglang and `import sglang` fails under {python}{where}: {reason}", fix)
    if version != SGLANG_VERSION:
        raise StepFailure(
            f"SGLang engines would run sglang {version} ({python}); megatron-rl needs {SGLANG_VERSION}", fix
        )
    return python, version


def check_install(cfg: RunConfig) -> StepOutcome:
    """The step: Python; torch, CUDA and the GPUs of a GPU recipe; the pinned packages against the lock; TE's FP8
    recipe class under ``train.precision`` fp8; SGLang where the engines run under ``rollout.engine`` sglang.

    Raises StepFailure at the first problem; the figures are the versions found.
    """
    python = ".".join(map(str, sys.version_info[:3]))
    outcome = StepOutcome(lines=[f"Python {python} ({sys.executable})"], figures={"python": python})
    lines, figures = check_devices(cfg)
    outcome.lines += lines
    outcome.figures |= figures
    lock = lock_file(cfg)
    if lock.is_file():
        pins = check_pins(lock)
        outcome.lines.append(f"{', '.join(f'{p} {v}' for p, v in pins.items())}: as {lock.relative_to(ROOT)} pins")
        outcome.figures["packages"] = pins
    else:
        outcome.lines.append(f"no lock file at {lock} (not a checkout): package versions not compared")
    if cfg.train.precision == "fp8":
        outcome.figures["transformer_engine"] = check_transformer_engine(cfg.train)
        outcome.lines.append(
            f"Transformer Engine {outcome.figures['transformer_engine']} imports, with the "
            f"{FP8_RECIPE_CLASSES[str(cfg.train.fp8_recipe)]} recipe of train.fp8_recipe={cfg.train.fp8_recipe}"
        )
    if cfg.rollout.engine == "sglang":
        sglang_interpreter, outcome.figures["sglang"] = check_sglang()
        outcome.lines.append(f"sglang {outcome.figures['sglang']} imports under {sglang_interpreter}")
    return outcome
