"""The step's data plane at a recipe's shapes: bytes each trainer rank receives, driver memory, seconds.

Builds one step of recipe R synthetically at its shapes (prompts up to ``rollout.max_prompt_length``,
responses long-tailed as in DAPO runs: most short, a tail to ``rollout.max_response_length``, about
7% cut at it; routed experts for every position of every sample) as the rollout manager hands it
to the driver (:class:`RolloutGroup` of :class:`RolloutSample`), then runs the driver's real path:
advantages, :func:`assemble_step_data`, :meth:`StepData.shard`, and
:meth:`TrainerGroup.train_step` into one Ray actor per data-parallel rank that stands in for the
ranks (no model: it records what it received). Model-parallel peers of a DP rank receive the same
shard, so one receiver per DP rank measures every rank's bytes.

Baseline, computed for the same step: the padded path this replaced sent every rank the whole step
as ``[B, S]`` int64 ids, bool mask, fp32 advantages, rollout and old log-probs and ``[B, S, L, K]``
int64 routed experts.

    PYTHONPATH=. .venv/bin/python benchmarks/step_data_plane.py [--recipe R] [--samples N1,N2,...] [recipe overrides]

The recipe is read as ``megatron-rl plan`` reads it: nothing needs to be downloaded (the architecture
comes from ``model.config_fallback``, the weights, data and network interface go unchecked), and
Ray runs on this machine's CPUs whatever nodes the recipe names.

The step runs at each ``--samples`` count (at least two; default: 1, 2 and 4 x the smallest count
that splits over mini-batches and DP), with routed experts, and the slope per sample between the
smallest and the largest count gives the full step's bytes. When the full step would not fit this
machine with its experts (at the DAPO shape about 19 GB of uint8 experts), it then runs at the full
per-step count without them: the balance of the shards over DP (the last line, ``per-rank bytes /
(step bytes / dp) = X``) is measured there through the same path, since a sample's expert bytes
are proportional to its tokens.
"""

from __future__ import annotations

import argparse
import gc
import math
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray

from megatron_rl.actor.step_data import StepData, expert_index_dtype
from megatron_rl.config import RunConfig, load_recipe, read_architecture, trainer_layout
from megatron_rl.orchestration.batch_assembly import assemble_step_data, group_advantages
from megatron_rl.orchestration.placement_group import create_rank_slots
from megatron_rl.orchestration.resources import start_ray
from megatron_rl.orchestration.trainer_group import TrainerGroup
from megatron_rl.orchestration.trainer_worker import ShardReceipt
from megatron_rl.orchestration.worker_group import RankWorkerGroup, WorkerSpec
from megatron_rl.rollout.groups import RolloutGroup, RolloutSample

ROOT = Path(__file__).resolve().parents[1]
TRUNCATED_FRACTION = 0.07


class ReceivingRank:
    """Stands in for every trainer rank of one data-parallel rank: takes its shard, reports what came."""

    def __init__(self, dp_size: int) -> None:
        import os

        self._rank = int(os.environ["RANK"])
        self._dp_rank = self._rank % dp_size

    def data_parallel_rank(self) -> int:
        return self._dp_rank

    def train_step(self, shard: StepData) -> tuple[dict[str, float], ShardReceipt]:
        return {}, ShardReceipt(self._rank, tuple(shard.sample_ids.tolist()), shard.nbytes())

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Shapes:
    """What a step of the recipe looks like."""

    prompts: int
    group_size: int
    max_prompt: int
    max_response: int
    layers: int
    top_k: int
    num_experts: int
    dp: int
    mini_batches: int


def recipe_shapes(cfg: RunConfig) -> Shapes:
    """The step's shapes; the architecture comes from ``model.config_fallback`` when the weights are absent."""
    arch = read_architecture(cfg.model.path, cfg.model.random_init, cfg.model.config_fallback)
    return Shapes(
        prompts=cfg.train.prompts_per_step,
        group_size=cfg.rollout.n_samples_per_prompt,
        max_prompt=cfg.rollout.max_prompt_length,
        max_response=cfg.rollout.max_response_length,
        layers=arch.num_layers,
        top_k=max(1, arch.moe_router_topk),
        num_experts=max(1, arch.num_experts),
        dp=trainer_layout(cfg.parallel, cfg.cluster, cfg.rollout).dp,
        mini_batches=cfg.train.mini_batches_per_step,
    )


def response_lengths(count: int, max_response: int, rng: np.random.Generator) -> np.ndarray:
    """Long-tailed lengths: log-normal with median max/10, cut at the maximum (about 7% land there)."""
    sigma = (math.log(max_response) - math.log(max_response / 10)) / 1.476  # P(X >= max) = 7%
    lengths = np.exp(rng.normal(math.log(max_response / 10), sigma, count))
    return np.clip(lengths.astype(np.int64), 1, max_response)


def synthetic_groups(shapes: Shapes, num_samples: int, *, experts: bool = True, seed: int = 0) -> list[RolloutGroup]:
    """``num_samples`` samples in groups of ``group_size``, with routed experts at every position (``experts``)."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(num_samples // shapes.group_size):
        prompt = rng.integers(0, 151_000, int(rng.integers(shapes.max_prompt // 4, shapes.max_prompt + 1))).tolist()
        samples = []
        for length in response_lengths(shapes.group_size, shapes.max_response, rng):
            response = rng.integers(0, 151_000, int(length)).tolist()
            positions = len(prompt) + len(response) - 1
            routed = (
                rng.integers(0, shapes.num_experts, (positions, shapes.layers, shapes.top_k), dtype=np.uint8)
                if experts
                else None
            )
            samples.append(
                RolloutSample(
                    prompt_ids=prompt,
                    response_ids=response,
                    rollout_logprobs=(-rng.random(len(response))).tolist(),
                    finish_reason="length" if length == shapes.max_response else "stop",
                    score=float(rng.integers(0, 2)),
                    correct=False,
                    overlong_penalty=0.0,
                    loss_mask=[1] * len(response),
                    weight_version="0",
                    routed_experts=routed,
                )
            )
        groups.append(RolloutGroup(f"g{g}", g, samples))
    return groups


def padded_bytes(step: StepData, shapes: Shapes) -> int:
    """What the padded path sent to EVERY rank for this step (see the module docstring)."""
    rows, seq = step.num_samples, int(step.lengths.max())
    per_token = 8 + 1 + 4 + 4  # int64 id, bool mask, fp32 rollout and old log-probs
    return rows * seq * per_token + rows * 4 + rows * seq * shapes.layers * shapes.top_k * 8


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_step(trainers: TrainerGroup, shapes: Shapes, num_samples: int, *, experts: bool = True) -> dict[str, float]:
    groups = synthetic_groups(shapes, num_samples, experts=experts)
    started = time.perf_counter()
    advantages = group_advantages(groups, norm_by_std=True)
    step = assemble_step_data(groups, advantages, expert_dtype=expert_index_dtype(shapes.num_experts))
    shards = step.shard(shapes.dp, shapes.mini_batches)
    sharded = time.perf_counter()
    _, receipts = trainers.train_step(shards)
    delivered = time.perf_counter()
    rank_bytes = max(receipt.nbytes for receipt in receipts)
    assert step.routed_experts is not None or not experts, "a step of routed samples carries their experts"
    result = {
        "samples": num_samples,
        "tokens": step.num_tokens,
        "step_bytes": step.nbytes(),
        "rank_bytes": rank_bytes,
        "ratio": rank_bytes / (step.nbytes() / shapes.dp),
        "experts": experts,
        "expert_bytes_per_entry": step.routed_experts.element_size() if step.routed_experts is not None else 0,
        "padded_bytes": padded_bytes(step, shapes) if experts else 0,
        "shard_s": sharded - started,
        "deliver_s": delivered - sharded,
        "driver_peak_gib": peak_rss_gib(),
    }
    del groups, step, shards
    gc.collect()
    return result


def load_shapes_only(recipe: str, overrides: list[str]) -> RunConfig:
    """The recipe as ``megatron-rl plan`` loads it: weights, data and the network interface may be absent.

    The benchmark reads only shapes, so the files a training run needs are not checked (as in ``plan``).
    """
    return load_recipe(recipe, overrides, require_files=False)[0]


def start_local_ray(cfg: RunConfig) -> None:
    """A Ray of this machine's CPUs on loopback: the receivers stand in for every node's ranks here."""
    cluster = cfg.cluster.model_copy(update={"nodes": 1, "gpus_per_node": 0, "network_interface": None})
    start_ray(cfg.model_copy(update={"cluster": cluster}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "qwen3_30b_a3b_dapo.yaml"))
    parser.add_argument(
        "--samples",
        type=lambda v: [int(n) for n in v.split(",")],
        help="samples per step to run, comma-separated (multiples of DP x group)",
    )
    args, overrides = parser.parse_known_args()
    if args.samples is not None and len(set(args.samples)) < 2:
        parser.error("--samples needs at least two counts: the bytes per sample are the slope between them")
    cfg = load_shapes_only(args.recipe, overrides)
    shapes = recipe_shapes(cfg)
    full = shapes.prompts * shapes.group_size
    unit = math.lcm(shapes.group_size, shapes.dp * shapes.mini_batches)
    counts = args.samples or [unit * k for k in (1, 2, 4)]
    print(f"# recipe {args.recipe}: {shapes}")
    print(f"# full step: {full} samples; running {counts}")
    start_local_ray(cfg)
    placement, slots = create_rank_slots(shapes.dp, num_gpus=0, num_cpus=0.01, name="data-plane")
    # ReceivingRank stands in for TrainerWorker in the calls TrainerGroup makes (ranks look methods up by name)
    trainers = TrainerGroup(
        RankWorkerGroup(WorkerSpec(ReceivingRank, shapes.dp), placement, slots, num_gpus=0, num_cpus=0.01)  # type: ignore[arg-type]
    )
    try:
        rows = [run_step(trainers, shapes, n) for n in counts]
        if max(counts) < full:  # the whole step through the same path, without the experts that would not fit here
            rows.append(run_step(trainers, shapes, full, experts=False))
    finally:
        trainers.close()
        ray.shutdown()
    header = f"{'samples':>8} {'tokens':>12} {'step GB':>9} {'rank GB':>9} {'rank/fair':>9} {'padded GB/rank':>15} {'shard s':>8} {'deliver s':>9} {'driver peak GiB':>15}"
    print(header)
    for r in rows:
        padded = f"{r['padded_bytes'] / 1e9:>15.1f}" if r["experts"] else f"{'(no experts)':>15}"
        print(
            f"{r['samples']:>8} {r['tokens']:>12,} {r['step_bytes'] / 1e9:>9.3f} {r['rank_bytes'] / 1e9:>9.3f} "
            f"{r['ratio']:>9.3f} {padded} {r['shard_s']:>8.2f} {r['deliver_s']:>9.2f} {r['driver_peak_gib']:>15.2f}"
        )
    with_experts = [r for r in rows if r["experts"]]
    first, last = min(with_experts, key=lambda r: r["samples"]), max(with_experts, key=lambda r: r["samples"])
    per_sample = (last["step_bytes"] - first["step_bytes"]) / (last["samples"] - first["samples"])
    per_sample_s = (last["shard_s"] + last["deliver_s"] - first["shard_s"] - first["deliver_s"]) / (
        last["samples"] - first["samples"]
    )
    print(
        f"# slope: {per_sample / 1e6:.2f} MB and {per_sample_s * 1e3:.2f} ms per sample; the full step of {full} "
        f"samples: ~{per_sample * full / 1e9:.1f} GB in all, ~{per_sample * full / shapes.dp / 1e9:.1f} GB per rank "
        f"(the padded path: {last['padded_bytes'] / last['samples'] * full / 1e9:,.0f} GB to every rank)"
    )
    print(f"# routed experts: {last['expert_bytes_per_entry']} byte(s) per (token, layer, k)")
    print(f"per-rank bytes / (step bytes / dp) = {rows[-1]['ratio']:.3f}  (at {rows[-1]['samples']} samples)")


if __name__ == "__main__":
    main()
