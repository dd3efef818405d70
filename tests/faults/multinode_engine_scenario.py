"""Run in a process joined to the two-node Ray cluster of ``test_two_nodes.py``: one reference engine whose two
node processes sit on both nodes, driven as a run drives it. Prints one JSON line of what it saw.

Usage: ``python -m tests.faults.multinode_engine_scenario MODEL_DIR LOG_DIR`` with ``RAY_ADDRESS`` set.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time

import ray
import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.engines import EngineUnavailableError, ReferenceEngine
from megatron_rl.engines.protocol import (
    GenerateRequest,
    InitWeightsUpdateGroupRequest,
    SamplingParams,
    UpdateWeightsFromDistributedRequest,
)
from megatron_rl.orchestration.engine_host import EngineHosts, EngineSpec
from megatron_rl.orchestration.network import RunNetwork
from megatron_rl.orchestration.placement_group import create_rank_slots, engine_node_slots
from megatron_rl.parallel.local_launch import free_port
from megatron_rl.plan.placement import ActorResources
from megatron_rl.wire.weight_group import broadcast_from_trainer, create_weight_group

REQUESTS = [
    GenerateRequest(
        input_ids=[1, 2, 3 + i],
        sampling_params=SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=100 + i),
        return_logprob=True,
    )
    for i in range(4)
]
WEIGHT = "model.embed_tokens.weight"
LOSS_NOTICED_S = 10.0


def _tokens(engine) -> list:
    return [[(s.output_ids, s.output_logprobs) for s in engine.generate(r)] for r in REQUESTS]


def _sync(client, shape: tuple[int, ...], value: float) -> list:
    """A distributed weight sync of one tensor into the engine, as the trainer (rank 0 of 1 + 2 engine ranks);
    the weight as the engine then reads it on every node (they must agree)."""
    port = free_port()
    join = threading.Thread(
        target=client.init_weights_update_group,
        args=(InitWeightsUpdateGroupRequest("127.0.0.2", port, 1, 3, "sync", "gloo"),),
    )
    join.start()
    group = create_weight_group("127.0.0.2", port, 0, 3, "sync", "gloo")
    join.join()
    tensor = torch.full(shape, value)
    client.begin_weight_update()
    update = threading.Thread(
        target=client.update_weights_from_distributed,
        args=(UpdateWeightsFromDistributedRequest([WEIGHT], ["float32"], [list(shape)], "sync", weight_version="7"),),
    )
    update.start()
    broadcast_from_trainer(group, tensor)
    update.join()
    client.end_weight_update()
    return client.request("/get_weights_by_name", {"name": WEIGHT, "truncate_size": 2})


def main(model: str, log_dir: str) -> None:
    ray.init(logging_level=logging.ERROR, log_to_driver=False)
    network = RunNetwork("lo")
    group, slots = create_rank_slots(2, num_gpus=0.0, num_cpus=0.8, name="multinode-engine")
    nodes = engine_node_slots(slots, nnodes=2)
    rollout = RolloutConfig(startup_timeout_s=120.0)
    base = EngineSpec("ref0", "reference", model, log_dir, rollout, seed=3, network=network, nnodes=2)
    specs = [dataclasses.replace(base, node_rank=k) for k in range(2)]
    hosts = EngineHosts([specs], group, [[node[0].bundle_index for node in nodes]], ActorResources(0.0, 0.4))
    one = ReferenceEngine("one", model, free_port(), log_dir=log_dir, seed=3)
    one.start()
    seen: dict = {"nodes": [node[0].node_ip for node in nodes]}
    try:
        hosts.wait_healthy()
        one.wait_healthy(120)
        (client,) = hosts.clients
        shape = tuple(torch.tensor(client.request("/get_weights_by_name", {"name": WEIGHT})).shape)
        seen["address"] = hosts.addresses[0][1]
        seen["same_as_one_node"] = _tokens(client) == _tokens(one)
        seen["synced"] = _sync(client, shape, 0.25)
        node_pids = hosts.node_pids(0)
        assert node_pids[1] is not None, "node 1 of the engine has a process"
        os.kill(node_pids[1], signal.SIGKILL)
        seen["crash_error"], deadline = "", time.monotonic() + LOSS_NOTICED_S
        while not seen["crash_error"] and time.monotonic() < deadline:  # node 0's /health fails once it noticed
            try:
                client.request("/health", timeout_s=1.0)
                time.sleep(0.05)
            except EngineUnavailableError as error:
                seen["crash_error"] = str(error)
        started = time.monotonic()
        hosts.restart(0)
        seen["restart_s"] = round(time.monotonic() - started, 1)
        seen["new_pids_differ"] = all(a != b for a, b in zip(node_pids, hosts.node_pids(0), strict=True))
        seen["after_restart_same"] = _tokens(client) == _tokens(one)
    finally:
        one.shutdown()
        hosts.close()
        ray.util.remove_placement_group(group)
    print(json.dumps(seen))


if __name__ == "__main__":
    main(*sys.argv[1:3])
