"""Device selection under torchrun and under Ray's one-GPU-per-actor assignment (only the device count is faked)."""

from __future__ import annotations

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
