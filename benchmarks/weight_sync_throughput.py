"""Weight-sync throughput into the reference engine vs a plain memory copy of the same bytes (CPU).

Builds a Qwen3 dense model of about 250M fp32 parameters (random init, written
once as a Hugging Face checkpoint), starts a reference engine on it with dummy
weights, and syncs the model's named tensors into it through the tensor
transport (shared-memory IPC) in buckets; then times a plain ``copy_`` of the
same tensors into preallocated buffers. Prints seconds, GB/s and the ratio.

    PYTHONPATH=. python benchmarks/weight_sync_throughput.py [--bucket-mb 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from megatron_rl.parallel.local_launch import free_port
from megatron_rl.rollout import ReferenceEngine
from megatron_rl.weight_sync.syncer import WeightSyncer
from megatron_rl.weight_sync.transports import TensorTransport

CONFIG = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=16,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False,
)  # fmt: skip


def _memcpy_seconds(named: list[tuple[str, torch.Tensor]], repeats: int) -> float:
    targets = [torch.empty_like(t) for _, t in named]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for target, (_, tensor) in zip(targets, named, strict=True):
            target.copy_(tensor)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**CONFIG))
    named = [(name, param.detach()) for name, param in model.named_parameters()]
    num_params = sum(t.numel() for _, t in named)
    num_bytes = sum(t.numel() * t.element_size() for _, t in named)
    with tempfile.TemporaryDirectory() as tmp:
        Qwen3Config(**CONFIG).save_pretrained(tmp)
        engine = ReferenceEngine("bench", tmp, free_port(), log_dir=Path(tmp), load_format="dummy")
        engine.start()
        try:
            engine.wait_healthy(600)
            syncer = WeightSyncer([engine], TensorTransport([engine]), bucket_bytes=args.bucket_mb << 20)
            sync_s = min(syncer.sync(named, f"v{i}").seconds for i in range(args.repeats))
            assert torch.equal(torch.tensor(engine.weights_by_name("model.norm.weight")), model.model.norm.weight)
        finally:
            engine.shutdown()
    copy_s = _memcpy_seconds(named, args.repeats)
    gb = num_bytes / 1e9
    print(
        f"model: {num_params / 1e6:.0f}M parameters, {gb:.2f} GB fp32; bucket {args.bucket_mb} MiB; best of {args.repeats}"
    )
    print(f"weight sync (tensor transport, shared memory): {sync_s:.3f} s = {gb / sync_s:.2f} GB/s")
    print(f"plain memory copy of the same bytes:           {copy_s:.3f} s = {gb / copy_s:.2f} GB/s")
    print(f"ratio sync / memcpy time: {sync_s / copy_s:.2f}x")


if __name__ == "__main__":
    main()
