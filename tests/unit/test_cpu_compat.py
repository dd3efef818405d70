"""The CPU compatibility layer patches exactly what it documents, and never with CUDA."""

import megatron.core.tensor_parallel.random as mcore_random
import pytest
import torch

from megatron_rl.parallel import cpu_compat


def _snapshot() -> dict[str, object]:
    attributes = {f"torch.cuda.{k}": v for k, v in vars(torch.cuda).items()}
    attributes |= {f"megatron.core.tensor_parallel.random.{k}": v for k, v in vars(mcore_random).items()}
    checkpoint_function = vars(mcore_random.CheckpointFunction)
    attributes |= {
        f"megatron.core.tensor_parallel.random.CheckpointFunction.{k}": v for k, v in checkpoint_function.items()
    }
    return attributes


def test_enable_refuses_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = _snapshot()
    with pytest.raises(RuntimeError, match="CPU-only"):
        cpu_compat.enable()
    assert _snapshot() == before
    assert not cpu_compat.is_enabled()


def test_enable_patches_exactly_the_documented_attributes_and_disable_restores_them():
    before = _snapshot()
    modes_before = torch._C._len_torch_function_stack()
    cpu_compat.enable()
    try:
        after = _snapshot()
        changed = {name for name in before if after[name] is not before[name]}
        assert changed == set(cpu_compat.PATCHED_ATTRIBUTES)
        assert torch._C._len_torch_function_stack() == modes_before + 1
    finally:
        cpu_compat.disable()
    assert _snapshot() == before
    assert torch._C._len_torch_function_stack() == modes_before


def test_cuda_device_arguments_become_cpu_while_enabled():
    cpu_compat.enable()
    try:
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
        assert torch.ones(2).to(torch.device("cuda", 0)).device.type == "cpu"
        assert torch.ones(2).to(0).device.type == "cpu"
        assert torch.ones(2).cuda().device.type == "cpu"
        assert torch.ones(2).type() == "torch.cuda.FloatTensor"
        assert torch.ones(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert torch.ones(2).type(torch.float64).dtype == torch.float64
    finally:
        cpu_compat.disable()


def test_rng_tracker_fork_is_reproducible_and_restores_the_outer_cpu_state():
    cpu_compat.enable()
    try:
        tracker = mcore_random.get_cuda_rng_tracker()
        tracker.reset()
        tracker.add("model-parallel-rng", 7)
        torch.manual_seed(0)
        outer_next = torch.rand(3)
        torch.manual_seed(0)
        with tracker.fork():
            first = torch.rand(3)
        assert torch.equal(torch.rand(3), outer_next)
        tracker.reset()
        tracker.add("model-parallel-rng", 7)
        with tracker.fork():
            assert torch.equal(torch.rand(3), first)
    finally:
        cpu_compat.disable()
