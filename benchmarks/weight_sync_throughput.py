"""Weight-sync throughput into the reference engine vs a plain memory copy of the same bytes (CPU).

Builds a Qwen3 dense model of 317M fp32 parameters (random init; its config written as a
Hugging Face directory), starts a reference engine on it with dummy weights, and syncs the
model's named tensors into it through the tensor transport, by bucket size, from two places:

- ``private``: the weights in the process's own memory (what a CPU trainer rank has): the
  transport packs each bucket into a reused shared buffer (copy 1) while the engine copies the
  previous one into its weights (copy 2);
- ``shared``: the same weights moved once into shared memory (``share_memory_()`` before the
  first sync, as a trainer would allocate them there): the transport sends views of them and the
  engine's copy into its weights is the only copy. This is the CPU form of the GPU path, where
  the transport sends the trainer's CUDA tensors as IPC handles and the engine's copy is the only one.

Each configuration gets a warm-up sync (buffers allocated and mapped once), then ``--repeats``
timed syncs, each after every weight changed (``+1``) and followed by a check that the engine
holds the new values bit for bit, then by a plain ``copy_`` of all the model's bytes into
preallocated tensors with one intra-op thread and with two. Times are medians. Each sync is paired
with the faster of the two plain copies timed right after it, and a row's ratio is the median of
its syncs' ratios to their paired copies (the box is shared: its load changes within a run, and
under load one thread can beat two); ``plain copy s`` is the median of those paired copies, and the
plain-copy rows are the medians over the whole run. The engine is started once per ``--engine-threads`` value (its torch
intra-op threads, used by its copy into its weights); the sender runs with one intra-op thread,
as trainer ranks do on CPU (``OMP_NUM_THREADS=1``).

    PYTHONPATH=. .venv/bin/python benchmarks/weight_sync_throughput.py [--buckets-mb 128,512,2048] [--repeats 5] [--engine-threads 1,2]

A second table breaks the zero-copy sync down (medians of ``--repeats`` after one round not kept, the model as one bucket):
the sync's control requests alone (a sync with no tensors: pause, flush, session open and close,
flush, continue), serializing the bucket's IPC handles, opening them (in this process), and the
engine's one copy (``copy_`` from the opened views into preallocated weights, 1 and 2 threads).

The last line states the ratio of the zero-copy configuration (shared memory, the largest bucket
size: one request carries the whole model) for each ``--engine-threads`` value, and the best ratio
from private memory. On the shared box an engine with two intra-op threads is fastest when the box
is quiet and slowest under load (its two threads wait for each other, as the two-thread plain
copy's do), so both are stated.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from benchmarks.sync_timing import engine_holds, plain_copy_seconds
from benchmarks.tables import print_table
from megatron_rl.engines import ReferenceEngine
from megatron_rl.parallel.local_launch import free_port
from megatron_rl.weight_sync.buckets import MIB
from megatron_rl.weight_sync.syncer import WeightSyncer
from megatron_rl.weight_sync.transports import TensorTransport
from megatron_rl.wire.tensor_serialization import deserialize_named_tensors, serialize_named_tensors

CONFIG: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=16,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False,
)  # fmt: skip
CHECKED = ("model.embed_tokens.weight", "model.layers.7.self_attn.k_proj.weight", "model.norm.weight", "lm_head.weight")
COPY_THREADS = (1, 2)

NamedTensors = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class Result:
    """Median sync seconds of one configuration, its bucket count, the median of the plain copies paired with
    its syncs and the median of each sync's ratio to its paired copy."""

    memory: str
    engine_threads: int
    bucket_mb: int
    buckets: int
    seconds: float
    baseline: float
    ratio: float


@torch.no_grad()
def _bump(named: NamedTensors) -> None:
    for _, tensor in named:
        tensor.add_(1.0)


def _measure(
    engine: ReferenceEngine, named: NamedTensors, bucket_mb: int, repeats: int, copy_s: dict[int, list[float]]
) -> tuple[float, int, float, float]:
    """Median timed sync of ``named`` at ``bucket_mb``, its bucket count, the median paired plain copy (the
    faster of one per intra-op thread count in ``copy_s`` after each sync, each appended there) and the
    median ratio of a sync to its paired copy."""
    paired: list[float] = []
    checked = [(name, tensor) for name, tensor in named if name in CHECKED]
    syncer = WeightSyncer([engine], TensorTransport([engine]), bucket_bytes=bucket_mb * MIB)
    seconds, buckets = [], 0
    try:
        torch.set_num_threads(1)
        syncer.sync(named, "warm-up")
        for repeat in range(repeats):
            _bump(named)
            torch.set_num_threads(1)
            stats = syncer.sync(named, f"{bucket_mb}MiB-{repeat}")
            engine_holds(engine, checked)
            seconds.append(stats.seconds)
            buckets = stats.num_buckets
            copies_now = []
            for threads, copies in copy_s.items():
                torch.set_num_threads(threads)
                copies_now.append(plain_copy_seconds(named, 1))
                copies.append(copies_now[-1])
            paired.append(min(copies_now))
    finally:
        syncer.close()
    ratios = [sync / copy for sync, copy in zip(seconds, paired, strict=True)]
    return statistics.median(seconds), buckets, statistics.median(paired), statistics.median(ratios)


def _timed(action) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


@torch.no_grad()
def _breakdown(engine: ReferenceEngine, shared: NamedTensors, repeats: int) -> dict[str, float]:
    """Median seconds of each part of a zero-copy sync of ``shared`` as one bucket (see the module docstring)."""
    parts: dict[str, list[float]] = {
        "control requests (sync of no tensors)": [], "serialize IPC handles": [], "open IPC handles": [],
        "engine copy, 1 thread": [], "engine copy, 2 threads": [],
    }  # fmt: skip
    targets = [torch.empty_like(tensor) for _, tensor in shared]
    syncer = WeightSyncer([engine], TensorTransport([engine]), bucket_bytes=1 << 40)
    try:
        for repeat in range(repeats + 1):  # the first round maps the buffers and touches the targets: not kept
            if repeat == 1:
                parts = {part: [] for part in parts}
            torch.set_num_threads(1)
            parts["control requests (sync of no tensors)"].append(_timed(lambda: syncer.sync([], "control")))
            start = time.perf_counter()
            payload = serialize_named_tensors(shared)
            parts["serialize IPC handles"].append(time.perf_counter() - start)
            start = time.perf_counter()
            opened = deserialize_named_tensors(payload)
            parts["open IPC handles"].append(time.perf_counter() - start)
            for threads in COPY_THREADS:
                torch.set_num_threads(threads)
                start = time.perf_counter()
                for target, (_, view) in zip(targets, opened, strict=True):
                    target.copy_(view)
                parts[f"engine copy, {threads} thread{'s' if threads > 1 else ''}"].append(time.perf_counter() - start)
    finally:
        syncer.close()
    return {part: statistics.median(seconds) for part, seconds in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buckets-mb", default="128,512,2048")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engine-threads", default="1,2")
    args = parser.parse_args()
    bucket_sizes = [int(size) for size in args.buckets_mb.split(",")]
    engine_threads = [int(threads) for threads in args.engine_threads.split(",")]
    threads_before = torch.get_num_threads()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**CONFIG))
    private = [(name, param.detach()) for name, param in model.named_parameters()]
    shared = [(name, tensor.clone().share_memory_()) for name, tensor in private]
    sources = {"private": private, "shared": shared}
    gb = sum(t.numel() * t.element_size() for _, t in private) / 1e9
    results: list[Result] = []
    copy_s: dict[int, list[float]] = {threads: [] for threads in COPY_THREADS}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            Qwen3Config(**CONFIG).save_pretrained(tmp)
            for threads in engine_threads:
                engine = ReferenceEngine(
                    f"bench-{threads}", tmp, free_port(), log_dir=Path(tmp), load_format="dummy", num_threads=threads
                )
                engine.start()
                try:
                    engine.wait_healthy(600)
                    if threads == engine_threads[-1]:
                        breakdown = _breakdown(engine, shared, args.repeats)
                    for bucket_mb in bucket_sizes:
                        for memory, named in sources.items():
                            start = time.perf_counter()
                            seconds, buckets, baseline, ratio = _measure(engine, named, bucket_mb, args.repeats, copy_s)
                            results.append(Result(memory, threads, bucket_mb, buckets, seconds, baseline, ratio))
                            print(
                                f"# {memory}, engine {threads} thread(s), {bucket_mb} MiB: "
                                f"{time.perf_counter() - start:.1f} s",
                                flush=True,
                            )
                finally:
                    engine.shutdown()
    finally:
        torch.set_num_threads(threads_before)
    copy_median = {threads: statistics.median(copies) for threads, copies in copy_s.items()}
    print(
        f"model: {sum(t.numel() for _, t in private) / 1e6:.0f}M parameters, {gb:.2f} GB fp32; medians of "
        f"{args.repeats} syncs per row and of {len(copy_s[1])} plain copies per thread count; sender 1 intra-op thread"
    )
    rows = [
        [f"plain copy, {threads} thread(s)", "-", "-", "-", f"{seconds:.3f}", f"{gb / seconds:.2f}", "-", "-"]
        for threads, seconds in copy_median.items()
    ]  # fmt: skip
    for r in results:
        rows.append(
            [f"tensor, {r.memory}", str(r.engine_threads), str(r.bucket_mb), str(r.buckets), f"{r.seconds:.3f}",
             f"{gb / r.seconds:.2f}", f"{r.baseline:.3f}", f"{r.ratio:.2f}"]
        )  # fmt: skip
    columns = ["path", "engine threads", "bucket MiB", "buckets", "seconds", "GB/s", "plain copy s", "/ plain copy"]
    print_table(columns, rows)
    print()
    print_table(["zero-copy sync, part", "seconds"], [[part, f"{sec:.4f}"] for part, sec in breakdown.items()])
    zero_copy = [r for r in results if r.memory == "shared" and r.bucket_mb == max(bucket_sizes)]
    best_private = min((r for r in results if r.memory == "private"), key=lambda r: r.ratio)
    print(
        f"tensor transport / plain copy, shared memory, {max(bucket_sizes)} MiB buckets: "
        + ", ".join(f"{r.ratio:.2f}x (engine {r.engine_threads} thread(s))" for r in zero_copy)
        + f"; from private memory {best_private.ratio:.2f}x (engine {best_private.engine_threads} thread(s), "
        f"{best_private.bucket_mb} MiB buckets)"
    )


if __name__ == "__main__":
    main()
