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
- ``--enable-deterministic-inference`` when ``rollout.deterministic_inference``: SGLang's
  batch-invariant kernels and seeded sampler, the only mode in which 0.5.23 reads a request's
  ``sampling_seed`` (``srt/sampling/sampling_batch_info.py``); the rollout manager sends a seed
  per sample (``GenerateRequest.sample_seeds``), so with it a sample's tokens depend only on its
  seed, prompt and weights: a restarted engine regenerates them. Cost: the SGLang team measured
  25-45% longer end-to-end rollout latency (34% on average, FlashInfer/FA3 with CUDA graphs; not
  measured here). It needs a deterministic attention backend (0.5.23: fa3, fa4, flashinfer,
  triton, ...; unset, SGLang picks fa3 on Hopper, flashinfer on Blackwell); the CPU's
  ``torch_native`` is not one, so a CPU engine with it refuses to start;
- ``--skip-server-warmup`` (the first generate warms up; saves start-up time);
- with a recipe's ``lora:``, ``--enable-lora --max-lora-rank R --lora-target-modules ... --max-loras-per-batch N``
  (and ``--experts-shared-outer-loras`` when asked); a CPU engine adds ``--lora-backend torch_native``
  (``sglang_pin.CPU_LORA_FLAGS``: the other LoRA backends are Triton kernels).

Where an engine sits (first GPU, ports, the one address it listens on, multi-node
address) is decided by the orchestrator and passed as :class:`SGLangPlacement`.

API key: SGLang takes it as ``--api-key`` only, and a command line is visible to
every user of the node (``ps``, ``/proc``), so :class:`SGLangEngine` writes it into
a YAML file only the user can read (``api-key: ...``, in a private temporary
directory) and passes ``--config FILE``, which SGLang 0.5.23 merges into its
arguments (``ConfigArgumentMerger``); the file is deleted once the server is
healthy (or stopped): on every node of an engine spanning nodes, whose host is told when node 0 is
(:meth:`HttpEngine.discard_start_secrets`). SGLang logs its resolved arguments, the key among them, so
the server's output reaches its log with the key redacted (``ServerProcess``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from megatron_rl.config.sglang_env import INSTALL_HINT, sglang_python
from megatron_rl.config.sglang_pin import (
    CONFIG_API_KEY,
    CONFIG_FILE_NAME,
    CONFIG_FLAG,
    CPU_FLAGS,
    CPU_LORA_FLAGS,
    DETERMINISTIC_INFERENCE_FLAG,
    EXPERTS_SHARED_OUTER_FLAG,
    LORA_FLAGS,
    MEMORY_SAVER_FLAGS,
    ROUTED_EXPERTS_FLAG,
)
from megatron_rl.engines.access import check_listen_host
from megatron_rl.engines.http_engine import HttpEngine
from megatron_rl.engines.server_process import ServerProcess
from megatron_rl.engines.sglang_cpu import cpu_engine_environment

if TYPE_CHECKING:  # the recipe schema imports models.hf_config; rollout stays import-free of it
    from megatron_rl.config.schema import LoRAConfig, RolloutConfig


@dataclass(frozen=True)
class SGLangPlacement:
    """Where one engine runs: ``base_gpu_id`` is its first local GPU; ports must be free on its node.

    ``dist_init_addr``/``nnodes``/``node_rank`` are for an engine spanning nodes (None/1/0 otherwise).
    ``device="cpu"``: SGLang's CPU path on a machine without a GPU (:mod:`~megatron_rl.engines.sglang_cpu`).
    """

    base_gpu_id: int
    port: int
    nccl_port: int
    host: str = "127.0.0.1"
    dist_init_addr: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    device: Literal["cuda", "cpu"] = "cuda"


def build_sglang_command(
    config: RolloutConfig,
    placement: SGLangPlacement,
    model_path: str | Path,
    *,
    routing_replay: bool = False,
    seed: int = 0,
    config_file: str | Path | None = None,
    python: str | None = None,
    lora: LoRAConfig | None = None,
) -> list[str]:
    """``python -m sglang.launch_server ...`` for one engine (``python``: default
    :func:`~megatron_rl.config.sglang_env.sglang_python`).

    ``config_file``: a YAML file of more arguments (``--config``; how the API key gets in). ``lora``: the recipe's
    ``lora:`` section, served with SGLang's LoRA flags (module docstring).
    Raises ValueError for a placement that cannot work (negative GPU id, port
    outside 1..65535, node_rank >= nnodes, several nodes without dist_init_addr,
    a wildcard host that would listen on every interface, a CPU engine without
    ``max_total_tokens``).
    """
    check_listen_host(placement.host)
    if placement.base_gpu_id < 0:
        raise ValueError(f"base_gpu_id must be >= 0, got {placement.base_gpu_id}")
    for name in ("port", "nccl_port"):
        if not 0 < getattr(placement, name) < 65536:
            raise ValueError(f"{name} must be in 1..65535, got {getattr(placement, name)}")
    if not 0 <= placement.node_rank < placement.nnodes:
        raise ValueError(f"node_rank {placement.node_rank} must be in [0, nnodes={placement.nnodes})")
    if placement.nnodes > 1 and not placement.dist_init_addr:
        raise ValueError("an engine spanning nodes (nnodes > 1) needs dist_init_addr (host:port of node 0)")
    if placement.device == "cpu" and config.max_total_tokens is None:
        raise ValueError("a CPU SGLang engine needs rollout.max_total_tokens (SGLang sizes its cache from host RAM)")
    python = python or sglang_python()
    if python is None:
        raise ValueError(f"no SGLang installation found: {INSTALL_HINT}")
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
        "--dtype", config.dtype,
        "--random-seed", str(seed),
        "--skip-tokenizer-init",
        "--skip-server-warmup",
    ]  # fmt: skip
    if config.max_total_tokens is not None:
        command += ["--max-total-tokens", str(config.max_total_tokens)]
    if placement.device == "cpu":
        command += CPU_FLAGS
    if placement.nnodes > 1:
        command += ["--dist-init-addr", str(placement.dist_init_addr)]
        command += ["--nnodes", str(placement.nnodes), "--node-rank", str(placement.node_rank)]
    if config.placement == "colocated" and placement.device == "cuda":  # the memory saver needs CUDA
        command += MEMORY_SAVER_FLAGS
    if routing_replay:
        command.append(ROUTED_EXPERTS_FLAG)
    if config.quantization is not None:
        command += ["--quantization", config.quantization]
    if config.deterministic_inference:
        command.append(DETERMINISTIC_INFERENCE_FLAG)
    if lora is not None:
        enable, max_rank, targets, slots = LORA_FLAGS
        command += [enable, max_rank, str(lora.rank), targets, *lora.target_modules]
        command += [slots, str(lora.max_loras_per_batch)]
        if lora.experts_shared_outer:
            command.append(EXPERTS_SHARED_OUTER_FLAG)
        if placement.device == "cpu":
            command += CPU_LORA_FLAGS
    if config_file is not None:
        command += [CONFIG_FLAG, str(config_file)]
    return command


def write_private_config(directory: str | Path, values: Mapping[str, str]) -> Path:
    """``directory/server.yaml`` holding ``values`` (SGLang flag names without dashes), readable by this user only."""
    path = Path(directory) / CONFIG_FILE_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        for key, value in values.items():
            if any(ord(c) < 32 for c in value):
                raise ValueError(f"{key}: a control character cannot go into SGLang's config file")
            quoted = value.replace("'", "''")
            file.write(f"{key}: '{quoted}'\n")  # single-quoted YAML scalar: nothing in it is interpreted
    return path


class SGLangEngine(HttpEngine):
    """An SGLang server process driven over its HTTP API (see :class:`HttpEngine`).

    ``die_with_parent``: the server is killed when the thread that starts it ends (see ``ServerProcess``).
    ``api_key``: the server's ``--api-key``, given through a private config file (module docstring);
    this client sends it. ``env``: more environment variables for the server (e.g. ``NCCL_SOCKET_IFNAME``);
    a CPU placement adds :func:`~megatron_rl.engines.sglang_cpu.cpu_engine_environment`. ``lora``: the recipe's
    ``lora:`` section (:func:`build_sglang_command`).
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
        api_key: str | None = None,
        env: Mapping[str, str] | None = None,
        lora: LoRAConfig | None = None,
    ) -> None:
        self._private_dir = tempfile.mkdtemp(prefix="megatron-rl-sglang-") if api_key else None  # mode 0700
        config_file = Path(self._private_dir, CONFIG_FILE_NAME) if self._private_dir else None
        command = build_sglang_command(
            config, placement, model_path, routing_replay=routing_replay, seed=seed, config_file=config_file, lora=lora
        )
        if placement.device == "cpu":
            env = {**(env or {}), **cpu_engine_environment()}
        process = ServerProcess(
            command,
            Path(log_dir) / f"{name}.log",
            env=env,
            die_with_parent=die_with_parent,
            secrets=[api_key] if api_key else [],
        )
        super().__init__(
            name,
            placement.host,
            placement.port,
            process=process,
            max_concurrent_requests=config.max_concurrent_requests,
            request_timeout_s=config.request_timeout_s,
            routed_experts_shape=routed_experts_shape if routing_replay else None,
            api_key=api_key,
        )

    def start(self) -> None:
        """Write the key's config file (SGLang reads it at start-up), then start the server."""
        if self._private_dir is not None:
            if not os.path.isdir(self._private_dir):  # started again after shutdown
                os.mkdir(self._private_dir, 0o700)
            self.discard_start_secrets()
            assert self._api_key is not None, "the private folder exists for the API key only"
            write_private_config(self._private_dir, {CONFIG_API_KEY: self._api_key})
        super().start()

    def discard_start_secrets(self) -> None:
        """Delete the key's config file: SGLang reads it with its arguments, before its node joins the engine."""
        if self._private_dir is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(Path(self._private_dir, CONFIG_FILE_NAME))

    def wait_healthy(self, timeout_s: float) -> None:
        """As :meth:`HttpEngine.wait_healthy`; the key's config file is deleted then (SGLang has read it)."""
        try:
            super().wait_healthy(timeout_s)
        finally:
            self.discard_start_secrets()

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            if self._private_dir is not None:
                shutil.rmtree(self._private_dir, ignore_errors=True)
