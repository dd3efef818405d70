"""SGLang engines (production): the server command line from the recipe, and the engine over HTTP.

Flags are SGLang 0.5.23's ``ServerArgs`` fields (checked against its own
argument parser in ``tests/unit/test_sglang_protocol.py`` when sglang is
importable). RL-specific choices:

- ``--skip-tokenizer-init``: the trainer sends token ids and reads token ids;
- ``--enable-memory-saver`` when colocated (release/resume of weights and KV
  cache around training), with the prefill CUDA graph disabled, which the
  memory saver needs (slime does the same);
- ``--enable-return-routed-experts`` when routing replay (R3) is on;
- ``--quantization fp8`` for FP8 rollouts;
- ``--skip-server-warmup`` (the first generate warms up; saves start-up time).

Where an engine sits (first GPU, ports, multi-node address) is decided by the
orchestrator and passed as :class:`SGLangPlacement`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rl.rollout.http_engine import HttpEngine
from megatron_rl.rollout.server_process import ServerProcess

if TYPE_CHECKING:  # the recipe schema imports models.hf_config; rollout stays import-free of it
    from megatron_rl.config.schema import RolloutConfig


@dataclass(frozen=True)
class SGLangPlacement:
    """Where one engine runs: ``base_gpu_id`` is its first local GPU; ports must be free on its node.

    ``dist_init_addr``/``nnodes``/``node_rank`` are for an engine spanning nodes (None/1/0 otherwise).
    """

    base_gpu_id: int
    port: int
    nccl_port: int
    host: str = "127.0.0.1"
    dist_init_addr: str | None = None
    nnodes: int = 1
    node_rank: int = 0


def build_sglang_command(
    config: RolloutConfig,
    placement: SGLangPlacement,
    model_path: str | Path,
    *,
    routing_replay: bool = False,
    seed: int = 0,
    python: str = sys.executable,
) -> list[str]:
    """``python -m sglang.launch_server ...`` for one engine.

    Raises ValueError for a placement that cannot work (negative GPU id, port
    outside 1..65535, node_rank >= nnodes, several nodes without dist_init_addr).
    """
    if placement.base_gpu_id < 0:
        raise ValueError(f"base_gpu_id must be >= 0, got {placement.base_gpu_id}")
    for name in ("port", "nccl_port"):
        if not 0 < getattr(placement, name) < 65536:
            raise ValueError(f"{name} must be in 1..65535, got {getattr(placement, name)}")
    if not 0 <= placement.node_rank < placement.nnodes:
        raise ValueError(f"node_rank {placement.node_rank} must be in [0, nnodes={placement.nnodes})")
    if placement.nnodes > 1 and not placement.dist_init_addr:
        raise ValueError("an engine spanning nodes (nnodes > 1) needs dist_init_addr (host:port of node 0)")
    command = [
        python, "-m", "sglang.launch_server",
        "--model-path", str(model_path),
        "--host", placement.host,
        "--port", str(placement.port),
        "--nccl-port", str(placement.nccl_port),
        "--base-gpu-id", str(placement.base_gpu_id),
        "--tp-size", str(config.tp),
        "--ep-size", str(config.ep),
        "--dp-size", str(config.dp),
        "--mem-fraction-static", str(config.mem_fraction),
        "--random-seed", str(seed),
        "--skip-tokenizer-init",
        "--skip-server-warmup",
    ]  # fmt: skip
    if placement.nnodes > 1:
        command += ["--dist-init-addr", str(placement.dist_init_addr)]
        command += ["--nnodes", str(placement.nnodes), "--node-rank", str(placement.node_rank)]
    if config.placement == "colocated":
        command += ["--enable-memory-saver", "--disable-prefill-cuda-graph"]
    if routing_replay:
        command.append("--enable-return-routed-experts")
    if config.quantization is not None:
        command += ["--quantization", config.quantization]
    return command


class SGLangEngine(HttpEngine):
    """An SGLang server process driven over its HTTP API (see :class:`HttpEngine`).

    ``die_with_parent``: the server is killed when the thread that starts it ends (see ``ServerProcess``).
    """

    def __init__(
        self,
        name: str,
        config: RolloutConfig,
        placement: SGLangPlacement,
        model_path: str | Path,
        *,
        log_dir: str | Path,
        routing_replay: bool = False,
        routed_experts_shape: tuple[int, int] | None = None,
        seed: int = 0,
        die_with_parent: bool = False,
    ) -> None:
        command = build_sglang_command(config, placement, model_path, routing_replay=routing_replay, seed=seed)
        super().__init__(
            name,
            placement.host,
            placement.port,
            process=ServerProcess(command, Path(log_dir) / f"{name}.log", die_with_parent=die_with_parent),
            max_concurrent_requests=config.max_concurrent_requests,
            request_timeout_s=config.request_timeout_s,
            routed_experts_shape=routed_experts_shape if routing_replay else None,
        )
