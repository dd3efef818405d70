"""Where engines go and what a host would launch, without Ray or SGLang: bundle plans, GPU ids, commands."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest

from megatron_rl.config import RecipeError, load_recipe
from megatron_rl.config.schema import RolloutConfig
from megatron_rl.engines import ReferenceEngine, SGLangEngine
from megatron_rl.engines.http_engine import HttpEngine
from megatron_rl.engines.server_process import ServerProcess
from megatron_rl.orchestration.engine_host import EngineSpec, build_engine, first_visible_index
from megatron_rl.orchestration.placement_group import (
    PlacementError,
    RankSlot,
    bundle_resources,
    check_capacity,
    engine_gpu_ids,
    engine_node_slots,
)
from megatron_rl.orchestration.resources import check_engines_beside_feeders, feeders_of_engines
from megatron_rl.plan.placement import ActorResources, plan_run_placement
from megatron_rl.weight_sync.engine_feeds import colocated_feeds, engine_feeders

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _load(overrides: list[str], *more: str):
    return load_recipe(RECIPES / "qwen3_30b_a3b_dapo.yaml", [*overrides, *more], require_files=False)[0]


def test_colocated_engines_share_every_trainer_bundle(qwen3_30b_overrides: list[str]) -> None:
    plan = plan_run_placement(_load(qwen3_30b_overrides))  # 4 nodes x 8 GPUs, engines tp 4
    assert plan.num_bundles == 32 and plan.bundle == ActorResources(num_gpus=1.0, num_cpus=1.0)
    assert plan.trainer_positions == tuple(range(32))
    assert plan.engine_positions == tuple(tuple(range(4 * e, 4 * e + 4)) for e in range(8))
    share = plan.trainer.num_gpus + plan.engine_host.num_gpus
    assert 0 < share <= 1 and plan.trainer.num_cpus + plan.engine_host.num_cpus <= 1


def test_disaggregated_engines_take_the_bundles_after_the_trainer(qwen3_30b_overrides: list[str]) -> None:
    cfg = _load(
        qwen3_30b_overrides, "rollout.placement=disaggregated", "rollout.num_gpus=16", "weight_sync.transport=auto"
    )
    plan = plan_run_placement(cfg)
    assert plan.trainer_positions == tuple(range(16)) and plan.trainer == ActorResources(1.0, 1.0)
    assert plan.engine_positions == tuple(tuple(range(16 + 4 * e, 20 + 4 * e)) for e in range(4))


def test_cpu_recipe_gives_each_rank_and_engine_a_bundle() -> None:
    cfg, _ = load_recipe(RECIPES / "tiny_moe_cpu_dapo.yaml", ["cluster.cpu_engines=2"])
    plan = plan_run_placement(cfg)
    assert plan.num_bundles == 4 and plan.bundle.num_gpus == 0
    assert plan.trainer_positions == (0, 1) and plan.engine_positions == ((2,), (3,))


def test_colocated_cpu_engines_on_several_nodes_sit_beside_the_ranks_that_feed_them() -> None:
    cfg, _ = load_recipe(
        RECIPES / "tiny_moe_cpu_dapo.yaml",
        ["cluster.nodes=2", "cluster.cpu_trainer_ranks=4", "cluster.cpu_engines=2", "cluster.network_interface=lo"],
    )
    plan = plan_run_placement(cfg)  # per node: its 2 trainer ranks, then its engine
    assert plan.trainer_positions == (0, 1, 3, 4) and plan.engine_positions == ((2,), (5,))
    feeds = colocated_feeds(4, [1, 1])
    for engine, (position,) in enumerate(plan.engine_positions):
        (feeder,) = [rank for rank, feed in enumerate(feeds) if feed is not None and feed.engine == engine]
        assert plan.trainer_positions[feeder] // 3 == position // 3  # the same node's block


def test_an_engine_of_whole_nodes_is_valid_and_partial_or_unfed_ones_are_refused(qwen3_30b_overrides) -> None:
    disaggregated = ("rollout.placement=disaggregated", "rollout.num_gpus=16", "weight_sync.transport=distributed")
    cfg = _load(qwen3_30b_overrides, "rollout.tp=16", "rollout.ep=16", *disaggregated)  # 2 nodes of 8 GPUs
    plan = plan_run_placement(cfg)
    assert plan.engine_nodes == 2 and plan.engine_positions == (tuple(range(16, 32)),)
    # Colocated with the per-GPU tensor transport: engine e's TP rank t sits on the GPU of trainer rank 16e + t,
    # which feeds it (SGLang puts TP ranks 8k.. on node k; tests/distributed/test_colocated_feed_across_nodes.py).
    colocated = plan_run_placement(_load(qwen3_30b_overrides, "rollout.tp=16", "rollout.ep=16"))
    assert colocated.engine_nodes == 2
    assert colocated.engine_positions == (tuple(range(16)), tuple(range(16, 32)))
    assert engine_feeders(32, [16, 16]) == [tuple(range(16)), tuple(range(16, 32))]
    refusals = {
        ("rollout.tp=12",): "rollout.tp: each engine takes rollout.tp (12) x rollout.dp (1) = 12 GPUs, more than "
        "cluster.gpus_per_node (8) and not a multiple of it",
        ("rollout.tp=8", "rollout.dp=2"): "rollout.dp: 2: SGLang 0.5.23 refuses data-parallel replicas in an engine "
        "spanning nodes",
        ("rollout.tp=64",): "rollout.tp: each engine spans 8 nodes",
    }
    for overrides, problem in refusals.items():
        with pytest.raises(RecipeError) as info:
            _load(qwen3_30b_overrides, *overrides)
        assert any(p.startswith(problem) for p in info.value.problems), (overrides, info.value.problems)
    with pytest.raises(RecipeError) as info:
        _load(qwen3_30b_overrides, "rollout.tp=2", "rollout.dp=3")
    assert any("6 GPUs per engine does not divide cluster.gpus_per_node (8)" in p for p in info.value.problems)


def _slots_on(nodes: list[str]) -> list[RankSlot]:
    """Bundle ``i`` on node ``nodes[i]``, its GPU the next free one there, in the given order."""
    return [RankSlot(index, ip, (str(nodes[:index].count(ip)),)) for index, ip in enumerate(nodes)]


def test_an_engine_spanning_two_nodes_passes_with_each_rank_beside_its_feeder_and_is_refused_otherwise(
    qwen3_30b_overrides,
) -> None:
    cfg = _load(qwen3_30b_overrides, "rollout.tp=16", "rollout.ep=16")  # 4 nodes x 8 GPUs, 2 engines of 2 nodes
    plan = plan_run_placement(cfg)
    feeders = feeders_of_engines(cfg, plan)
    assert plan.engine_nodes == 2 and feeders == [tuple(range(16)), tuple(range(16, 32))]
    grouped = _slots_on([f"10.0.0.{1 + index // 8}" for index in range(32)])  # as create_rank_slots sorts them
    check_engines_beside_feeders(grouped, plan, feeders)  # TP ranks 8-15 and their feeders on each engine's 2nd node
    # Engine 0's first node, 10.0.0.1, holds bundles 0-3 and 12-15, so SGLang puts its TP ranks 0-7 there and 8-15 on
    # 10.0.0.2, while trainer ranks 4-7 sit on 10.0.0.2 and 12-15 on 10.0.0.1.
    interleaved = _slots_on(
        ["10.0.0.1"] * 4 + ["10.0.0.2"] * 8 + ["10.0.0.1"] * 4 + ["10.0.0.3"] * 8 + ["10.0.0.4"] * 8
    )
    with pytest.raises(PlacementError) as refused:
        check_engines_beside_feeders(interleaved, plan, feeders)
    message = str(refused.value)
    assert message.startswith("Ray placed engine 0's ranks on other nodes than the trainer ranks that feed them")
    assert "TP rank 4 on 10.0.0.1, fed by trainer rank 4 on 10.0.0.2" in message
    assert "TP rank 12 on 10.0.0.2, fed by trainer rank 12 on 10.0.0.1" in message
    assert "TP rank 3 " not in message and "TP rank 8 " not in message and "weight_sync.transport=disk" in message


def test_an_engines_bundles_split_by_node_equally_or_are_refused() -> None:
    slots = [RankSlot(0, "10.0.0.1", ("6",)), RankSlot(1, "10.0.0.1", ("7",)), RankSlot(2, "10.0.0.2", ("0",))]
    with pytest.raises(ValueError, match="it needs 1 on each of 2 nodes"):
        engine_node_slots(slots, nnodes=2)  # 2 on one node, 1 on the other: SGLang needs tp / nnodes on each
    with pytest.raises(ValueError, match="on nodes"):
        engine_gpu_ids(slots[1:])
    nodes = engine_node_slots([*slots, RankSlot(3, "10.0.0.2", ("1",))], nnodes=2)
    assert [engine_gpu_ids(node) for node in nodes] == [("6", "7"), ("0", "1")]
    assert engine_gpu_ids([RankSlot(3, "10.0.0.1", ("2",)), RankSlot(4, "10.0.0.1", ("3",))]) == ("2", "3")


@pytest.mark.parametrize(
    ("gpu_ids", "visible", "index"),
    [(("4", "5"), None, 4), (("4", "5"), "", 4), (("5", "6"), "4,5,6,7", 1), (("GPU-a",), "GPU-b,GPU-a", 1)],
)
def test_base_gpu_id_indexes_the_visible_devices(gpu_ids, visible, index) -> None:
    assert first_visible_index(gpu_ids, visible) == index


@pytest.mark.parametrize(
    ("gpu_ids", "visible", "message"),
    [
        (("3",), "4,5", r"\['3'\] are not in CUDA_VISIBLE_DEVICES"),
        (("4", "6"), "4,5,6", "consecutive"),
        ((), None, "at least one"),
    ],
)
def test_unusable_gpu_ids_are_named(gpu_ids, visible, message) -> None:
    with pytest.raises(ValueError, match=message):
        first_visible_index(gpu_ids, visible)


def _spec(kind: Literal["sglang", "reference"], gpu_ids: tuple[str, ...], **rollout) -> EngineSpec:
    config = RolloutConfig(engine=kind, **rollout)
    return EngineSpec("e1", kind, "/models/qwen", "/logs", config, seed=7, gpu_ids=gpu_ids, routing_replay=True)


def _process(engine: HttpEngine) -> ServerProcess:
    """The server process ``build_engine`` prepared for ``engine`` (not started)."""
    assert engine.process is not None
    return engine.process


def test_sglang_host_command_for_its_bundles() -> None:
    spec = _spec("sglang", ("2", "3"), tp=2, ep=2, placement="colocated", mem_fraction=0.6)
    engine = build_engine(spec, host="10.0.0.5", port=30001, nccl_port=30002, visible_devices="0,1,2,3,4,5,6,7")
    assert isinstance(engine, SGLangEngine) and engine.base_url == "http://10.0.0.5:30001"
    command = _process(engine).command
    flags = dict(zip(command[3::2], command[4::2], strict=False))
    assert command[1:3] == ["-m", "sglang.launch_server"]
    assert flags["--base-gpu-id"] == "2" and flags["--port"] == "30001" and flags["--nccl-port"] == "30002"
    assert flags["--host"] == "10.0.0.5" and flags["--tp-size"] == "2" and flags["--mem-fraction-static"] == "0.6"
    assert {"--enable-memory-saver", "--disable-prefill-cuda-graph", "--enable-return-routed-experts"} <= set(command)
    assert "--dist-init-addr" not in command and _process(engine).die_with_parent

    disaggregated = build_engine(
        _spec("sglang", ("6",), placement="disaggregated"), host="h", port=1, nccl_port=2, visible_devices="4,5,6,7"
    )
    command = _process(disaggregated).command
    assert "--enable-memory-saver" not in command
    assert command[command.index("--base-gpu-id") + 1] == "2"


def test_sglang_host_without_gpus_runs_sglangs_cpu_path_without_a_prefix_cache() -> None:
    """No GPU ids: CPU flags, no memory saver, and no radix cache, so the run's syncer needs no flush."""
    engine = build_engine(
        _spec("sglang", (), placement="colocated", max_total_tokens=4096),
        host="h",
        port=1,
        nccl_port=2,
        visible_devices=None,
    )
    command = _process(engine).command
    assert command[command.index("--device") + 1] == "cpu" and "--disable-radix-cache" in command
    assert "--enable-memory-saver" not in command
    cfg, _ = load_recipe(RECIPES / "tiny_moe_cpu_dapo_sglang.yaml", require_files=False)
    assert cfg.sglang_on_cpu  # the trainer workers build their syncer with flush_cache=False


def test_reference_host_runs_on_cpu_or_its_first_gpu() -> None:
    on_cpu = build_engine(_spec("reference", ()), host="h", port=5, nccl_port=6, visible_devices=None)
    on_gpu = build_engine(_spec("reference", ("5",)), host="h", port=5, nccl_port=6, visible_devices="4,5")
    assert isinstance(on_cpu, ReferenceEngine) and _process(on_cpu).die_with_parent
    for engine, device in ((on_cpu, "cpu"), (on_gpu, "cuda:1")):
        command = _process(engine).command
        assert command[command.index("--device") + 1] == device and command[command.index("--host") + 1] == "h"


def test_four_cpu_trainer_ranks_and_an_engine_fit_two_cores() -> None:
    cfg, _ = load_recipe(
        RECIPES / "tiny_moe_cpu_dapo.yaml",
        ["cluster.cpu_trainer_ranks=4", "parallel.tp=2", "parallel.sequence_parallel=true"],
    )
    plan = plan_run_placement(cfg)
    assert plan.num_bundles == 5 and plan.num_bundles * plan.bundle.num_cpus <= 2.0
    check_capacity(plan.num_bundles, bundle_resources(0.0, plan.bundle.num_cpus), {"CPU": 2.0})


def test_a_shortage_names_what_was_asked_and_what_the_cluster_has() -> None:
    with pytest.raises(PlacementError, match=r"6 bundles of \{'CPU': 0.4\}.*too small: CPU 2.4 \(has 2\)"):
        check_capacity(6, {"CPU": 0.4}, {"CPU": 2.0})
    with pytest.raises(PlacementError, match=r"GPU 32 \(has 8\)"):
        check_capacity(32, {"CPU": 1.0, "GPU": 1.0}, {"CPU": 64.0, "GPU": 8.0})
