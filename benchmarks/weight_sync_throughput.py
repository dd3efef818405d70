"""Weight-sync throughput into the reference engine vs a plain memory copy of the same bytes (CPU), by bucket size.

Builds a Qwen3 dense model of 317M fp32 parameters (random init; its config written as a
Hugging Face directory), starts a reference engine on it with dummy weights, and syncs the
model's named tensors into it through the tensor transport (shared-memory IPC: the sender packs
each bucket into a reused shared buffer while the engine copies the previous one into its
weights). Each bucket size gets a warm-up sync (buffers allocated and mapped once), then
``--repeats`` timed syncs, each after every weight changed (``+1``) and followed by a check that
the engine holds the new values bit for bit. A plain ``copy_`` of the same tensors runs after
each sync, with one intra-op thread and with this process's default; every ratio is against the
fastest plain copy of the run (on a busy box one thread can beat two).

The sender packs with ``--sender-threads`` intra-op threads (default 1, as trainer ranks run on
CPU: ``OMP_NUM_THREADS=1``). Two pipelined single-thread copies (pack, engine load) on two
cores take at least one single-thread copy: the ``plain copy, 1 thread`` row is that floor.

    PYTHONPATH=. .venv/bin/python benchmarks/weight_sync_throughput.py [--buckets-mb 64,128,256,512,1024] [--repeats 5]

The last line states the tensor transport's ratio to the plain copy at its best bucket size.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from benchmarks.sync_timing import engine_holds, plain_copy_seconds, print_table
from megatron_rl.parallel.local_launch import free_port
from megatron_rl.rollout import ReferenceEngine
from megatron_rl.weight_sync.buckets import MIB
from megatron_rl.weight_sync.syncer import WeightSyncer
from megatron_rl.weight_sync.transports import TensorTransport

CONFIG = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=16,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False,
)  # fmt: skip
CHECKED = ("model.embed_tokens.weight", "model.layers.7.self_attn.k_proj.weight", "model.norm.weight", "lm_head.weight")


@torch.no_grad()
def _bump(named: list[tuple[str, torch.Tensor]]) -> None:
    for _, tensor in named:
        tensor.add_(1.0)


def _sync_seconds(
    engine: ReferenceEngine,
    named: list[tuple[str, torch.Tensor]],
    bucket_mb: int,
    args: argparse.Namespace,
    copy_s: dict[int, list[float]],
) -> tuple[float, int]:
    """Best timed sync at ``bucket_mb`` and its bucket count; after each sync, appends a plain copy's
    seconds for every intra-op thread count in ``copy_s``."""
    checked = [(name, tensor) for name, tensor in named if name in CHECKED]
    threads_before = torch.get_num_threads()
    syncer = WeightSyncer([engine], TensorTransport([engine]), bucket_bytes=bucket_mb * MIB)
    try:
        torch.set_num_threads(args.sender_threads)
        syncer.sync(named, "warm-up")
        best, buckets = float("inf"), 0
        for repeat in range(args.repeats):
            _bump(named)
            torch.set_num_threads(args.sender_threads)
            stats = syncer.sync(named, f"{bucket_mb}MiB-{repeat}")
            engine_holds(engine, checked)
            best, buckets = min(best, stats.seconds), stats.num_buckets
            for threads, seconds in copy_s.items():
                torch.set_num_threads(threads)
                seconds.append(plain_copy_seconds(named, 1))
    finally:
        torch.set_num_threads(threads_before)
        syncer.close()
    return best, buckets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buckets-mb", default="64,128,256,512,1024")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sender-threads", type=int, default=1)
    args = parser.parse_args()
    bucket_sizes = [int(size) for size in args.buckets_mb.split(",")]
    copy_threads = torch.get_num_threads()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**CONFIG))
    named = [(name, param.detach()) for name, param in model.named_parameters()]
    gb = sum(t.numel() * t.element_size() for _, t in named) / 1e9
    syncs: dict[int, tuple[float, int]] = {}
    copy_s: dict[int, list[float]] = {copy_threads: [], 1: []}
    with tempfile.TemporaryDirectory() as tmp:
        Qwen3Config(**CONFIG).save_pretrained(tmp)
        engine = ReferenceEngine("bench", tmp, free_port(), log_dir=Path(tmp), load_format="dummy")
        engine.start()
        try:
            engine.wait_healthy(600)
            for bucket_mb in bucket_sizes:
                start = time.perf_counter()
                syncs[bucket_mb] = _sync_seconds(engine, named, bucket_mb, args, copy_s)
                print(f"# {bucket_mb} MiB buckets: {time.perf_counter() - start:.1f} s", flush=True)
        finally:
            engine.shutdown()
    copy_best = min(min(seconds) for seconds in copy_s.values())
    print(
        f"model: {sum(t.numel() for _, t in named) / 1e6:.0f}M parameters, {gb:.2f} GB fp32; best of {args.repeats}; "
        f"sender {args.sender_threads} intra-op thread(s), plain copy 1 and {copy_threads}"
    )
    rows = [
        [f"plain copy, {threads} thread(s)", "-", "-", f"{min(seconds):.3f}", f"{gb / min(seconds):.2f}",
         f"{min(seconds) / copy_best:.2f}"]
        for threads, seconds in copy_s.items()
    ]  # fmt: skip
    for bucket_mb, (seconds, buckets) in syncs.items():
        rows.append(
            ["tensor transport", str(bucket_mb), str(buckets), f"{seconds:.3f}", f"{gb / seconds:.2f}",
             f"{seconds / copy_best:.2f}"]
        )  # fmt: skip
    print_table(["path", "bucket MiB", "buckets", "seconds", "GB/s", "/ plain copy"], rows)
    best_mb = min(syncs, key=lambda size: syncs[size][0])
    print(f"tensor transport / plain copy: {syncs[best_mb][0] / copy_best:.2f}x (best bucket size, {best_mb} MiB)")


if __name__ == "__main__":
    main()
