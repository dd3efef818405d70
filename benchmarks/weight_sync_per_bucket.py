"""The tensor transport's cost per bucket: engine calls from kept threads against a thread pool made per bucket.

An HTTP engine client keeps one connection per thread. The tensor transport used to post each
bucket from a thread pool made for that bucket, so every bucket started a thread and opened a
connection (and the server a thread for it); it now keeps its engine threads for its life
(``transports._engine_threads``). Both ways are timed in one process, alternating: a reference
engine (its own process, HTTP) with the tiny recipe's Qwen3-MoE (2 layers of width 64, 4 experts)
synced one tensor per bucket, so the seconds are the requests' and not the bytes'. The baseline, "a pool
per bucket", runs the same transport with its calls routed through a pool made per call.

    PYTHONPATH=. .venv/bin/python benchmarks/weight_sync_per_bucket.py [--repeats 20]

The last line: milliseconds per bucket, a pool per bucket over kept threads.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from benchmarks.tables import print_table
from megatron_rl.config import load_recipe
from megatron_rl.engines import ReferenceEngine
from megatron_rl.parallel.local_launch import free_port
from megatron_rl.weight_sync import transports
from megatron_rl.weight_sync.syncer import WeightSyncer
from megatron_rl.weight_sync.transports import TensorTransport

_RANDOM_INIT = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "tiny_moe_cpu_dapo.yaml")[
    0
].model.random_init
assert _RANDOM_INIT is not None, "the tiny recipe builds its model from model.random_init"
CONFIG = {key: value for key, value in _RANDOM_INIT.items() if key != "architectures"}
"""The tiny recipe's model (``model.random_init``)."""
KEPT = transports._on_every_engine


def _pool_per_call(engines, call, pool) -> None:
    """The code before: a pool made for every call, whatever the transport keeps."""
    with ThreadPoolExecutor(max_workers=len(engines)) as per_call:
        KEPT(engines, call, per_call)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="syncs per way, after one warm-up sync each")
    args = parser.parse_args()
    torch.manual_seed(0)
    named = [
        (n, p.detach().clone().share_memory_())
        for n, p in Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG)).named_parameters()
    ]
    ways = {"a pool per bucket": _pool_per_call, "kept threads": KEPT}
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    with tempfile.TemporaryDirectory() as tmp:
        Qwen3MoeConfig(**CONFIG).save_pretrained(tmp)
        engine = ReferenceEngine("per-bucket", tmp, free_port(), log_dir=Path(tmp), load_format="dummy")
        engine.start()
        syncer = WeightSyncer([engine], TensorTransport([engine]), bucket_bytes=1)  # one tensor per bucket
        try:
            engine.wait_healthy(300)
            for repeat in range(args.repeats + 1):
                order = list(ways) if repeat % 2 == 0 else list(reversed(ways))
                for way in order:
                    transports._on_every_engine = ways[way]
                    start = time.perf_counter()
                    stats = syncer.sync(named, f"{repeat}-{way}")
                    if repeat:
                        seconds[way].append((time.perf_counter() - start) / stats.num_buckets)
        finally:
            transports._on_every_engine = KEPT
            syncer.close()
            engine.shutdown()
    ms = {way: 1e3 * statistics.median(values) for way, values in seconds.items()}
    print_table(
        ["engine calls from", "buckets per sync", "ms per bucket (median)"],
        [[way, str(len(named)), f"{ms[way]:.3f}"] for way in ways],
    )
    print(
        f"tensor transport, ms per bucket: a pool per bucket {ms['a pool per bucket']:.2f} / kept threads "
        f"{ms['kept threads']:.2f} = {ms['a pool per bucket'] / ms['kept threads']:.2f}x"
    )


if __name__ == "__main__":
    main()
