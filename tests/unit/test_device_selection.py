"""Device selection under torchrun and under Ray's one-GPU-per-actor assignment (only the device count is faked),
and whether Transformer Engine is usable (its import faked)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from megatron_rl.parallel import device


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int, local_rank: int, visible: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)


def test_a_ray_actor_given_one_gpu_takes_it_whatever_its_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 1, local_rank=5, visible="5")
    assert device.select_device() == torch.device("cuda", 0)


def test_a_torchrun_rank_seeing_the_whole_node_takes_its_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 8, local_rank=3, visible="0,1,2,3,4,5,6,7")
    assert device.select_device() == torch.device("cuda", 3)


def test_a_local_rank_beyond_the_visible_gpus_is_refused_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 2, local_rank=2, visible="4,5")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=2 but this process sees 2 GPUs \(CUDA_VISIBLE_DEVICES=4,5\)"):
        device.select_device()


def test_without_a_gpu_everything_derives_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 0, local_rank=1, visible="")
    assert device.select_device() == torch.device("cpu")
    assert device.collective_backend() == "gloo"
    assert not device.transformer_engine_usable()


@pytest.fixture
def fresh_te_import(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A process with a GPU whose Transformer Engine import has not been tried yet."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    device._transformer_engine_import_problem.cache_clear()
    yield
    device._transformer_engine_import_problem.cache_clear()


def test_without_a_gpu_transformer_engine_is_unusable_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device.transformer_engine_problem() == "this process sees no CUDA device"


@pytest.mark.usefixtures("fresh_te_import")
def test_a_gpu_without_transformer_engine_names_the_install_command() -> None:
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer_engine is installed here")
    assert not device.transformer_engine_usable()
    problem = device.transformer_engine_problem()
    assert problem is not None and problem.startswith("transformer_engine is not installed in ")
    assert "./launch/setup.sh --gpu" in problem


class _BrokenExtension(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``transformer_engine.pytorch`` as a build against another torch loads it: its extension fails to link."""

    ERROR = "transformer_engine_torch.cpython-312-x86_64-linux-gnu.so: undefined symbol: _ZN3c104cuda9SetDeviceEa"

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname == "transformer_engine.pytorch" else None

    def exec_module(self, module: types.ModuleType) -> None:
        raise ImportError(self.ERROR)


def _install_te_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed (empty) ``transformer_engine`` package, so the import of its ``pytorch`` module is tried."""
    package = types.ModuleType("transformer_engine")
    package.__path__ = []
    package.__spec__ = importlib.machinery.ModuleSpec("transformer_engine", None, is_package=True)
    monkeypatch.setitem(sys.modules, "transformer_engine", package)


@pytest.mark.usefixtures("fresh_te_import")
def test_a_broken_transformer_engine_build_is_unusable_with_its_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _install_te_package(monkeypatch)
    monkeypatch.setattr(sys, "meta_path", [_BrokenExtension(), *sys.meta_path])

    with pytest.warns(RuntimeWarning, match="undefined symbol"):
        assert not device.transformer_engine_usable()
    problem = device.transformer_engine_problem()  # the import is tried once per process: no second warning
    assert problem == (
        "transformer_engine is installed but `import transformer_engine.pytorch` fails: "
        f"ImportError: {_BrokenExtension.ERROR} (a build against another torch or CUDA? "
        "./launch/setup.sh --gpu builds TE 2.20.2 against this venv's torch)"
    )
    assert "transformer_engine.pytorch" not in sys.modules


@pytest.mark.usefixtures("fresh_te_import")
def test_a_transformer_engine_that_imports_is_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    _install_te_package(monkeypatch)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", types.ModuleType("transformer_engine.pytorch"))
    assert device.transformer_engine_usable()
    assert device.transformer_engine_problem() is None


def test_a_declared_gpu_arch_other_than_the_gpus_is_named_with_the_fix() -> None:
    b200 = device.gpu_arch_mismatch("hopper", (10, 0), "NVIDIA B200")
    assert b200 == (
        "cluster.gpu_arch is 'hopper', but this GPU is NVIDIA B200 (compute capability 10.0: blackwell); validate "
        "decides with cluster.gpu_arch which FP8 recipes and FP8 rollouts can run here (mxfp8 needs blackwell, FP8 "
        "rollouts hopper), so set cluster.gpu_arch=blackwell"
    )
    h100 = device.gpu_arch_mismatch("blackwell", (9, 0), "NVIDIA H100 80GB HBM3")
    assert h100 is not None and "NVIDIA H100 80GB HBM3 (compute capability 9.0: hopper)" in h100
    assert h100.endswith("set cluster.gpu_arch=hopper")


@pytest.mark.parametrize(
    ("declared", "capability"),
    [("hopper", (9, 0)), ("blackwell", (10, 0)), ("blackwell", (10, 3)), ("hopper", (8, 0)), ("blackwell", (12, 0))],
)
def test_a_gpu_arch_that_matches_or_a_gpu_the_field_cannot_name_passes(declared, capability) -> None:
    assert device.gpu_arch_mismatch(declared, capability, "a GPU") is None


def _one_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], name: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_the_gpu_arch_check_reads_this_processs_gpu_and_passes_without_one(monkeypatch: pytest.MonkeyPatch) -> None:
    device.check_gpu_arch("blackwell")  # this machine's CPU
    _one_gpu(monkeypatch, (9, 0), "NVIDIA H200")
    device.check_gpu_arch("hopper")
    with pytest.raises(ValueError, match=r"this GPU is NVIDIA H200 \(compute capability 9.0: hopper\)"):
        device.check_gpu_arch("blackwell")


def test_a_trainer_rank_on_a_gpu_of_another_arch_than_declared_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """A B200 run left at the default cluster.gpu_arch (hopper): validate passes FP8 rollouts, the rank refuses."""
    from megatron_rl.config import load_recipe
    from megatron_rl.orchestration.trainer_worker import RankPaths, TrainerWorker

    recipes = Path(__file__).resolve().parents[2] / "recipes"
    cfg, _ = load_recipe(recipes / "tiny_moe_cpu_dapo.yaml", ["cluster.gpus_per_node=2"])
    assert cfg.cluster.gpu_arch == "hopper"
    _one_gpu(monkeypatch, (10, 0), "NVIDIA B200")
    with pytest.raises(ValueError, match=r"cluster.gpu_arch is 'hopper', but this GPU is NVIDIA B200"):
        TrainerWorker(cfg, RankPaths.of(cfg, tmp_path / "never_read"))
