"""The real SGLang 0.5.23 server on this machine's CPU, and our reference engine beside it.

One SGLang engine (started through :class:`~megatron_rl.engines.sglang_engine.SGLangEngine`, the
production launcher) and one reference engine, both with the same API key, serve the same tiny Qwen3-MoE
checkpoint, fp32, for the whole session. Tests that change weights put the checkpoint's back.
The tests skip when no SGLang installation is found (``./launch/setup.sh --sglang``); ``.ci/run``
fails on any skip here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.config.schema import LoRAConfig, RolloutConfig
from megatron_rl.config.sglang_env import INSTALL_HINT, sglang_python
from megatron_rl.engines import ReferenceEngine, SGLangEngine, SGLangPlacement
from megatron_rl.engines.http_engine import HttpEngine
from megatron_rl.parallel.local_launch import free_port
from tests.api_key_cases import API_KEY
from tests.tiny_checkpoints import save_tiny_moe

STARTUP_TIMEOUT_S = 240.0
CPU_ROLLOUT: dict[str, Any] = dict(engine="sglang", dtype="float32", max_total_tokens=4096, request_timeout_s=600.0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason=f"no SGLang installation: {INSTALL_HINT}") if sglang_python() is None else None
    for item in items:
        if Path(__file__).parent in Path(item.path).parents:
            item.add_marker(pytest.mark.sglang)
            if skip is not None:
                item.add_marker(skip)


def start_sglang(
    model_dir: Path,
    log_dir: Path,
    name: str = "sglang",
    api_key: str | None = API_KEY,
    lora: LoRAConfig | None = None,
    **rollout: Any,
) -> SGLangEngine:
    """A healthy CPU SGLang engine serving ``model_dir`` (the caller shuts it down); ``lora``: it serves adapters."""
    config = RolloutConfig(**(CPU_ROLLOUT | rollout))
    placement = SGLangPlacement(base_gpu_id=0, port=free_port(), nccl_port=free_port(), device="cpu")
    engine = SGLangEngine(name, config, placement, model_dir, log_dir=log_dir, seed=1, api_key=api_key, lora=lora)
    engine.start()
    try:
        engine.wait_healthy(STARTUP_TIMEOUT_S)
    except BaseException:
        engine.shutdown()
        raise
    return engine


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE (4 MoE layers, 4 experts top-2; vocab 100; 2048 positions), fp32."""
    path = tmp_path_factory.mktemp("sglang-hf") / "moe"
    return save_tiny_moe(path, max_position_embeddings=2048, all_sparse=True)


@pytest.fixture(scope="session")
def moe_weights(moe_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under their on-disk names."""
    return load_file(moe_dir / "model.safetensors")


@pytest.fixture(scope="session")
def sglang(moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangEngine]:
    engine = start_sglang(moe_dir, tmp_path_factory.mktemp("sglang-logs"))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def reference(moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpEngine]:
    log_dir = tmp_path_factory.mktemp("reference-logs")
    engine = ReferenceEngine("reference", moe_dir, free_port(), log_dir=log_dir, api_key=API_KEY)
    engine.start()
    engine.wait_healthy(STARTUP_TIMEOUT_S)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def moe_dir_b(moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same architecture with every weight changed: what the weight-update tests send."""
    from tests.sglang.transformers_decode import load_model

    model = load_model(moe_dir)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    target = tmp_path_factory.mktemp("sglang-hf-b") / "moe"
    model.save_pretrained(target)
    return target


@pytest.fixture(scope="session")
def moe_weights_b(moe_dir_b: Path) -> dict[str, torch.Tensor]:
    return load_file(moe_dir_b / "model.safetensors")


@pytest.fixture
def restore_weights(sglang: SGLangEngine, moe_dir: Path) -> Iterator[SGLangEngine]:
    """The session's SGLang engine, given the checkpoint's weights back (from disk) after the test."""
    from megatron_rl.engines.protocol import UpdateWeightsFromDiskRequest

    yield sglang
    sglang.continue_generation()
    sglang.update_weights_from_disk(UpdateWeightsFromDiskRequest(str(moe_dir), weight_version="default"))
