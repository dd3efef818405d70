"""Ray worker groups: ranks get the launcher environment and form a working gloo process group."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import ray
import torch
import torch.distributed as dist

from megatron_rl.orchestration.placement_group import PlacementError, create_rank_slots
from megatron_rl.orchestration.worker_group import RankArgs, RankWorkerGroup, WorkerSpec

pytestmark = pytest.mark.distributed


class _AllReduceWorker:
    def __init__(self, offset: int) -> None:
        dist.init_process_group("gloo")
        self.offset = offset

    def environment(self) -> tuple[int, int, int]:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])

    def all_reduce_rank(self) -> float:
        value = torch.tensor([float(dist.get_rank() + self.offset)])
        dist.all_reduce(value)
        return value.item()

    def echo(self, value: int) -> int:
        return value * 10 + dist.get_rank()


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ranks_get_launcher_env_and_all_reduce(local_ray: None) -> None:
    group_pg, slots = create_rank_slots(2, num_gpus=0, num_cpus=1)
    group = RankWorkerGroup(WorkerSpec(_AllReduceWorker, 1), group_pg, slots, num_gpus=0, num_cpus=1)
    try:
        assert group.call(_AllReduceWorker.environment) == [(0, 2, 0), (1, 2, 1)]
        assert group.call(_AllReduceWorker.all_reduce_rank) == [3.0, 3.0]
        assert group.call_per_rank(_AllReduceWorker.echo, [RankArgs(1), RankArgs(2)]) == [10, 21]
        with pytest.raises(TypeError, match="_AllReduceWorker, the ranks' worker class, has no method 'upper'"):
            group.call(str.upper)  # type: ignore[arg-type]
    finally:
        group.shutdown()
        ray.util.remove_placement_group(group_pg)


def test_unplaceable_request_fails_fast_with_what_exists(local_ray: None) -> None:
    with pytest.raises(PlacementError, match=r"Ray cluster is too small: GPU 1 \(has 0\)"):
        create_rank_slots(1, num_gpus=1, num_cpus=1, timeout_s=3)
