"""Dynamic sampling: generation batches sent as soon as they are certain to be needed, against one after the other.

DAPO's dynamic sampling takes generation batches until ``prompts_per_step`` groups with signal are
kept. Sent one after the other, each batch waits for the one before to end, and the engine spends
the end of every batch decoding the few longest responses of its last groups. The rollout manager
now sends the next batch as soon as the groups kept plus those not yet known to be dropped cannot
fill the step (``StepPolicy(early_batches=True)``, its default without partial rollouts): the
same batches, seeds and kept groups, without the engine idling or running near-empty at each
batch's end.

Two rollout managers on one reference engine (its own process, over HTTP), with the same prompts,
seeds and reward, one with ``early_batches`` and one without; their steps alternate, and which of
the two goes first alternates too. Each step's kept groups (tokens, log-probs, scores) and counts
must be the same in both, and are checked. Workload: the tiny recipe's model (random weights, EOS
token 2, so responses end at random, most short and some cut at ``--max-new``), 8 prompts per
step, generation batches of 8 prompts x 16 samples, up to 4 batches, temperature 1; a share
``--constant-share`` of the prompts has no signal (every response scores 1), the others score the
parity of the first token (``tests/rollout_rewards.py``), so most steps take several batches.

    PYTHONPATH=. .venv/bin/python benchmarks/early_generation_batches.py [--steps 8] [--max-new 48] [--device cuda]

Per arm: median step seconds, the engine's forward-pass and idle seconds per step (its ``GET
/metrics``), generation batches and samples per step. The last line: the step time sent one after
the other over sent early.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig

from benchmarks.tables import print_table
from megatron_rl.config import load_recipe
from megatron_rl.config.schema import DynamicSamplingConfig, OverlongConfig, RolloutConfig
from megatron_rl.data import PromptDataset, PromptItem, PromptSampler
from megatron_rl.engines import ReferenceEngine
from megatron_rl.engines.protocol import FORWARD_SECONDS_METRIC, IDLE_SECONDS_METRIC, metric_total
from megatron_rl.parallel.local_launch import free_port
from megatron_rl.rollout.groups import RolloutStep
from megatron_rl.rollout.manager import RolloutManager
from tests.rollout_managers import build_manager

ROOT = Path(__file__).resolve().parents[1]
REWARD = "tests.rollout_rewards:first_token_parity"
EOS = 2
PROMPTS = 512
PROMPTS_PER_STEP = 8


def _save_model_config(root: Path) -> Qwen3MoeConfig:
    """The tiny recipe's model config, with EOS token ``EOS`` (inside its 32-token vocabulary), saved in ``root``."""
    init = load_recipe(ROOT / "recipes" / "tiny_moe_cpu_dapo.yaml")[0].model.random_init
    assert init is not None, "the tiny recipe builds its model from model.random_init"
    config = Qwen3MoeConfig(**{k: v for k, v in init.items() if k != "architectures"}, eos_token_id=EOS)
    config.save_pretrained(root)
    return config


def _dataset(constant_share: float, vocab: int) -> PromptDataset:
    """``PROMPTS`` prompts of 4-8 random tokens (ids 3 and up); a share ``constant_share`` without signal."""
    rng = torch.Generator().manual_seed(0)
    items = []
    for index in range(PROMPTS):
        ids = torch.randint(3, vocab, (int(torch.randint(4, 9, (1,), generator=rng)),), generator=rng).tolist()
        constant = float(torch.rand((), generator=rng)) < constant_share
        items.append(PromptItem(index, ids, "constant" if constant else "mixed", "bench"))
    return PromptDataset(items, 0)


def _manager(engine: ReferenceEngine, dataset: PromptDataset, max_new: int, early: bool) -> RolloutManager:
    rollout = RolloutConfig(engine="reference", n_samples_per_prompt=16, max_response_length=max_new)
    return build_manager(
        [engine],
        dataset,
        PromptSampler(len(dataset), PROMPTS_PER_STEP, seed=0),
        rollout.model_copy(update={"max_concurrent_requests": 64}),
        OverlongConfig(enable=False),
        DynamicSamplingConfig(enable=True, max_gen_batches=4, on_exhausted="train_partial"),
        prompts_per_step=PROMPTS_PER_STEP,
        reward=REWARD,
        reward_num_workers=1,
        reward_timeout_s=60.0,
        decode=lambda ids: " ".join(map(str, ids)),
        uid_prefix="early" if early else "sequential",
        seed=1,
        early_batches=early,
    )


def _outcome(step: RolloutStep) -> tuple:
    groups = [
        (
            g.uid.removeprefix("early").removeprefix("sequential"),
            [(s.response_ids, s.rollout_logprobs, s.score) for s in g.samples],
        )
        for g in step.groups
    ]
    return groups, {name: value for name, value in step.metrics.items() if name != "rollout/seconds"}


def _difference(outcomes: dict[str, tuple]) -> str:
    """What differs between the two arms' outcomes of one step (for the failure message)."""
    (early_groups, early_metrics), (sequential_groups, sequential_metrics) = outcomes["early"], outcomes["sequential"]
    early_uids, sequential_uids = [uid for uid, _ in early_groups], [uid for uid, _ in sequential_groups]
    if early_uids != sequential_uids:
        return f"kept groups {early_uids} against {sequential_uids}"
    for (uid, early), (_, sequential) in zip(early_groups, sequential_groups, strict=True):
        for index, (a, b) in enumerate(zip(early, sequential, strict=True)):
            if a != b:
                field = "tokens" if a[0] != b[0] else "log-probs" if a[1] != b[1] else "scores"
                return f"group {uid} sample {index}: {field} differ"
    changed = sorted(name for name in early_metrics if early_metrics[name] != sequential_metrics.get(name))
    return f"metrics {changed} differ"


def _timed_step(manager: RolloutManager, engine: ReferenceEngine) -> tuple[RolloutStep, dict[str, float]]:
    before = engine.request("/metrics")
    start = time.perf_counter()
    step = manager.generate_step()
    seconds = time.perf_counter() - start
    after = engine.request("/metrics")
    return step, {
        "seconds": seconds,
        "forward": metric_total(after, FORWARD_SECONDS_METRIC) - metric_total(before, FORWARD_SECONDS_METRIC),
        "idle": metric_total(after, IDLE_SECONDS_METRIC) - metric_total(before, IDLE_SECONDS_METRIC),
        "batches": step.metrics["rollout/gen_batches"],
        "samples": step.metrics["rollout/samples"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="steps per arm, after one warm-up step each")
    parser.add_argument("--max-new", type=int, default=48, help="max_response_length (the model has 64 positions)")
    parser.add_argument("--constant-share", type=float, default=0.75, help="share of prompts without signal")
    parser.add_argument("--device", default="cpu", help="the engine's device (cuda: scripts/device_check.py)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config = _save_model_config(root)
        engine = ReferenceEngine("bench", root, free_port(), log_dir=root, load_format="dummy", device=args.device)
        engine.start()
        managers: dict[str, RolloutManager] = {}
        try:
            engine.wait_healthy(300)
            dataset = _dataset(args.constant_share, config.vocab_size)
            managers = {arm: _manager(engine, dataset, args.max_new, arm == "early") for arm in ("early", "sequential")}
            for manager in managers.values():
                manager.generate_step()
            timings: dict[str, list[dict[str, float]]] = {arm: [] for arm in managers}
            for step in range(args.steps):
                order = ("early", "sequential") if step % 2 == 0 else ("sequential", "early")
                outcomes = {}
                for arm in order:
                    result, timing = _timed_step(managers[arm], engine)
                    outcomes[arm] = _outcome(result)
                    timings[arm].append(timing)
                    print(f"step {step} {arm}: {timing['seconds']:.3f} s, {timing['batches']:.0f} batches", flush=True)
                if outcomes["early"] != outcomes["sequential"]:
                    raise SystemExit(f"step {step}: early batches are not exact: {_difference(outcomes)}")
        finally:
            for manager in managers.values():
                manager.close()
            engine.shutdown()
    medians = {arm: {key: statistics.median(t[key] for t in rows) for key in rows[0]} for arm, rows in timings.items()}
    labels = {"sequential": "one batch after the other", "early": "sent when certain to be needed"}
    print_table(
        [
            "generation batches",
            "step s (median)",
            "engine forward s",
            "engine idle s",
            "batches",
            "samples",
            "samples/s",
        ],
        [
            [
                labels[arm],
                f"{m['seconds']:.3f}",
                f"{m['forward']:.3f}",
                f"{m['idle']:.3f}",
                f"{m['batches']:.0f}",
                f"{m['samples']:.0f}",
                f"{m['samples'] / m['seconds']:.0f}",
            ]
            for arm, m in (("sequential", medians["sequential"]), ("early", medians["early"]))
        ],
    )
    ratio = medians["sequential"]["seconds"] / medians["early"]["seconds"]
    print(
        f"dynamic sampling step, batches one after the other / sent when certain to be needed: {ratio:.2f}x "
        f"(same groups in all {args.steps} steps)"
    )


if __name__ == "__main__":
    main()
