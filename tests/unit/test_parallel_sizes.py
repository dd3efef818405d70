"""ParallelSizes: Megatron's ETP default, the smallest world that fits, and errors naming the size."""

import pytest

from megatron_rl.parallel.device import select_device
from megatron_rl.parallel.distributed import ParallelSizes


def test_expert_tp_defaults_to_tp():
    assert ParallelSizes(tp=2).expert_tp == 2
    assert ParallelSizes(tp=2, etp=1).expert_tp == 1


@pytest.mark.parametrize(
    "sizes, world",
    [
        (ParallelSizes(), 1),
        (ParallelSizes(tp=2, pp=2, ep=2, etp=1), 4),
        (ParallelSizes(tp=2, ep=2, etp=2), 4),
        (ParallelSizes(tp=1, ep=4, etp=1), 4),
        (ParallelSizes(tp=4, ep=2, etp=1), 4),
    ],
)
def test_min_world_size_fits_dense_and_expert_layouts(sizes, world):
    assert sizes.min_world_size == world
    sizes.validate(world)


def test_validate_names_the_layout_that_does_not_fit():
    with pytest.raises(ValueError, match="etp\\*ep\\*pp"):
        ParallelSizes(tp=2, ep=4, etp=2).validate(4)
    with pytest.raises(ValueError, match="tp\\*pp\\*cp"):
        ParallelSizes(tp=4).validate(2)
    with pytest.raises(ValueError, match="vpp=2 needs pp >= 2"):
        ParallelSizes(vpp=2).validate(1)


def test_cpu_is_selected_without_cuda():
    assert select_device().type == "cpu"
