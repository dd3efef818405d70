"""The reference engine as a :class:`RolloutEngine`: our own server process, driven by the SGLang client."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_rl.engines.access import API_KEY_ENV, check_listen_host
from megatron_rl.engines.http_engine import HttpEngine
from megatron_rl.engines.protocol import LoRASettings
from megatron_rl.engines.server_process import ServerProcess


def build_reference_command(
    model_path: str | Path,
    port: int,
    *,
    host: str = "127.0.0.1",
    load_format: str = "auto",
    dtype: str = "float32",
    device: str | None = None,
    seed: int = 0,
    num_threads: int = 1,
    nnodes: int = 1,
    node_rank: int = 0,
    dist_init_addr: str | None = None,
    lora: LoRASettings | None = None,
    python: str = sys.executable,
) -> list[str]:
    """``python -m megatron_rl.engines.reference.server ...`` for one engine (ValueError for a wildcard host;
    ``num_threads``: torch intra-op threads). ``nnodes``/``node_rank``/``dist_init_addr``: one node process
    of an engine spanning nodes, SGLang's flags (:mod:`~megatron_rl.engines.reference.node_group`);
    ValueError for a node rank outside [0, nnodes) or several nodes without ``dist_init_addr``.

    ``lora``: serve LoRA adapters within these limits (``--enable-lora --max-lora-rank R
    --lora-target-modules ... --max-loras-per-batch N``, SGLang's flags).

    Never carries an API key: the key goes through the environment (:data:`~megatron_rl.engines.access.API_KEY_ENV`).
    """
    command = [python, "-m", "megatron_rl.engines.reference.server", "--model-path", str(model_path)]
    command += ["--host", check_listen_host(host), "--port", str(port), "--load-format", load_format, "--dtype", dtype]
    command += ["--seed", str(seed), "--num-threads", str(num_threads)]
    if device is not None:
        command += ["--device", device]
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank {node_rank} must be in [0, nnodes={nnodes})")
    if nnodes > 1:
        if not dist_init_addr:
            raise ValueError("an engine spanning nodes (nnodes > 1) needs dist_init_addr (host:port of node 0)")
        command += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--dist-init-addr", dist_init_addr]
    if lora is not None:
        command += [
            "--enable-lora",
            "--max-lora-rank",
            str(lora.max_rank),
            "--lora-target-modules",
            *lora.target_modules,
            "--max-loras-per-batch",
            str(lora.max_loras_per_batch),
        ]
    return command


class ReferenceEngine(HttpEngine):
    """A reference server process on ``host:port`` (see :mod:`megatron_rl.engines.reference.server`).

    ``routed_experts_shape`` = (num_hidden_layers, num_experts_per_tok) decodes routing in results;
    ``num_threads``: the server's torch intra-op threads on CPU (its forward passes and weight loads);
    ``die_with_parent``: the server is killed when the thread that starts it ends (see ``ServerProcess``).
    ``api_key``: the server requires it (passed in its environment, kept out of its log) and this
    client sends it; ``env``: more environment variables for the server (e.g. ``GLOO_SOCKET_IFNAME``).
    ``nnodes``/``node_rank``/``dist_init_addr``: one node process of an engine spanning nodes (only node
    rank 0 serves HTTP, so only its client talks to it). ``lora``: the server serves LoRA adapters
    (:func:`build_reference_command`).
    """

    def __init__(
        self,
        name: str,
        model_path: str | Path,
        port: int,
        *,
        log_dir: str | Path,
        host: str = "127.0.0.1",
        load_format: str = "auto",
        dtype: str = "float32",
        device: str | None = None,
        seed: int = 0,
        num_threads: int = 1,
        max_concurrent_requests: int = 64,
        request_timeout_s: float = 600.0,
        routed_experts_shape: tuple[int, int] | None = None,
        die_with_parent: bool = False,
        api_key: str | None = None,
        env: Mapping[str, str] | None = None,
        nnodes: int = 1,
        node_rank: int = 0,
        dist_init_addr: str | None = None,
        lora: LoRASettings | None = None,
    ) -> None:
        command = build_reference_command(
            model_path,
            port,
            host=host,
            load_format=load_format,
            dtype=dtype,
            device=device,
            seed=seed,
            num_threads=num_threads,
            nnodes=nnodes,
            node_rank=node_rank,
            dist_init_addr=dist_init_addr,
            lora=lora,
        )
        server_env = dict(env or {}) | {API_KEY_ENV: api_key or ""}  # never a key inherited from this process
        process = ServerProcess(
            command,
            Path(log_dir) / f"{name}.log",
            env=server_env,
            die_with_parent=die_with_parent,
            secrets=[api_key] if api_key else [],
        )
        super().__init__(
            name,
            host,
            port,
            process=process,
            max_concurrent_requests=max_concurrent_requests,
            request_timeout_s=request_timeout_s,
            routed_experts_shape=routed_experts_shape,
            api_key=api_key,
        )

    def weights_by_name(self, name: str, truncate_size: int = 1 << 30) -> list[Any]:
        """A weight's values as nested lists (SGLang's ``/get_weights_by_name``; exact for fp32)."""
        weights: list[Any] = self.request("/get_weights_by_name", {"name": name, "truncate_size": truncate_size})
        return weights
