"""DP balancing and micro-batch padding on long-tailed RL response lengths, against simpler splits.

A step of recipe R is built synthetically at its shapes (``train.prompts_per_step`` groups of
``rollout.n_samples_per_prompt``, ``train.mini_batches_per_step`` contiguous mini-batches, the
recipe's DP size), with lengths as RL rollouts have them: each prompt's length uniform in
``[max_prompt / 8, max_prompt]``; responses log-normal (median ``max_response / 8`` times a
per-prompt difficulty factor ``exp(N(0, 0.5))``, sigma 0.8) cut at ``max_response_length``, plus
a mass of 10% of the responses cut at the maximum. Each mini-batch is split over the DP ranks by:

* ``ours``: ``balance_across_dp`` (Karmarkar-Karp on ``sequence_workload`` with equal counts,
  then ``refine_by_swaps``), the function ``StepData.shard`` calls;
* ``KK alone``: the same Karmarkar-Karp without the swaps (what ``balance_across_dp`` was before);
* ``naive``: contiguous slices of the mini-batch;
* ``round-robin``: samples sorted by length (longest first) dealt to ranks 0, 1, ..., DP-1, 0, ...

Per method, over every mini-batch of every seed: DP imbalance (max / mean over ranks) of tokens
and of the workload model, the worst and the mean over mini-batches; the micro-batches per
update (``token_budget_micro_batches`` under ``train.max_tokens_per_micro_batch``, the count
agreed over DP with the MAX protocol of ``plan_micro_batches``); and the padding waste (padded
tokens / real tokens) of those micro-batches on the packed path (GPU with Transformer Engine:
``plan_micro_batch_packing``, one T per schedule call) and on the padded path (CPU:
``padded_micro_batches``' one ``[rows, S]`` shape agreed over DP).

The ``bound`` rows are lower bounds (``equal_count_bound``) on what any split with equal counts
per rank can reach: the worst is the largest bound over the mini-batches.

Besides each recipe's own shape, the first recipe runs at fewer prompts per step (``--limits``)
to show where equal counts per rank stop balancing. The last line states the worst token
imbalance of ``ours`` over the recipes' own shapes and its ratio to ``naive``'s.

    PYTHONPATH=. .venv/bin/python benchmarks/balancing.py [--recipes R1,R2] [--seeds 5] [--limits 128,64]
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_rl.actor.packing import packing_rule, padded_sequence_multiple, plan_micro_batch_packing
from megatron_rl.config import load_recipe, trainer_layout
from megatron_rl.data.balancing import balance_across_dp, karmarkar_karp_partition, sequence_workload
from megatron_rl.data.micro_batching import token_budget_micro_batches

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("recipes/qwen3_30b_a3b_dapo.yaml", "recipes/tiny_moe_cpu_dapo.yaml")
TRUNCATED_MASS = 0.10
DIFFICULTY_SIGMA = 0.5
RESPONSE_SIGMA = 0.8

Split = Callable[[Sequence[int], int], list[list[int]]]


@dataclass(frozen=True)
class Shape:
    """One step's shape, read from a recipe (``prompts`` possibly overridden)."""

    name: str
    prompts: int
    group_size: int
    max_prompt: int
    max_response: int
    dp: int
    mini_batches: int
    budget: int
    tp: int
    sequence_parallel: bool
    fp8_recipe: str | None

    @property
    def per_rank(self) -> int:
        """Samples per DP rank per mini-batch."""
        return self.prompts * self.group_size // self.mini_batches // self.dp


def recipe_shape(path: str, prompts: int | None = None) -> Shape:
    overrides = [f"train.prompts_per_step={prompts}"] if prompts else []
    cfg = load_recipe(ROOT / path, overrides, require_files=False)[0]
    return Shape(
        name=Path(path).stem if prompts is None else f"{Path(path).stem} @{prompts} prompts",
        prompts=cfg.train.prompts_per_step,
        group_size=cfg.rollout.n_samples_per_prompt,
        max_prompt=cfg.rollout.max_prompt_length,
        max_response=cfg.rollout.max_response_length,
        dp=trainer_layout(cfg.parallel, cfg.cluster, cfg.rollout).dp,
        mini_batches=cfg.train.mini_batches_per_step,
        budget=cfg.train.max_tokens_per_micro_batch,
        tp=cfg.parallel.tp,
        sequence_parallel=cfg.parallel.sequence_parallel,
        fp8_recipe=cfg.train.fp8_recipe if cfg.train.precision == "fp8" else None,
    )


def step_lengths(shape: Shape, seed: int) -> list[int]:
    """Prompt + response tokens of every sample of one step, group by group (module docstring)."""
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    for _ in range(shape.prompts):
        prompt = int(rng.integers(max(1, shape.max_prompt // 8), shape.max_prompt + 1))
        median = shape.max_response / 8 * math.exp(rng.normal(0.0, DIFFICULTY_SIGMA))
        responses = np.exp(rng.normal(math.log(median), RESPONSE_SIGMA, shape.group_size))
        responses = np.clip(responses.astype(np.int64), 1, shape.max_response)
        responses[rng.random(shape.group_size) < TRUNCATED_MASS] = shape.max_response
        lengths += [prompt + int(response) for response in responses]
    return lengths


def karmarkar_karp_alone(lengths: Sequence[int], dp: int) -> list[list[int]]:
    return karmarkar_karp_partition([sequence_workload(length) for length in lengths], dp, equal_size=True)


def naive(lengths: Sequence[int], dp: int) -> list[list[int]]:
    size = len(lengths) // dp
    return [list(range(rank * size, (rank + 1) * size)) for rank in range(dp)]


def round_robin(lengths: Sequence[int], dp: int) -> list[list[int]]:
    longest_first = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [longest_first[rank::dp] for rank in range(dp)]


METHODS: dict[str, Split] = {
    "ours": balance_across_dp,
    "KK alone": karmarkar_karp_alone,
    "naive": naive,
    "round-robin": round_robin,
}


def imbalance(parts: Sequence[Sequence[int]], values: Sequence[int]) -> float:
    totals = [sum(values[i] for i in part) for part in parts]
    return max(totals) / (sum(totals) / len(totals))


def equal_count_bound(values: Sequence[int], dp: int) -> float:
    """A lower bound on max / mean over ranks of ANY split of ``values`` into ``dp`` equal counts.

    Pigeonhole: of the ``j * dp + 1`` largest items some rank holds ``j + 1``, each at least the
    ``(j * dp + 1)``-th largest, and its other ``m - j - 1`` items (m per rank) weigh at least the
    ``m - j - 1`` smallest.
    """
    per_rank, descending = len(values) // dp, sorted(values, reverse=True)
    ascending = descending[::-1]
    heaviest = max((j + 1) * descending[j * dp] + sum(ascending[: per_rank - j - 1]) for j in range(per_rank))
    return max(1.0, heaviest / (sum(values) / dp))


def padding(shape: Shape, ranks: list[list[int]]) -> tuple[int, int, int, int]:
    """(micro-batches per rank, real tokens, packed-path tokens, padded-path tokens) of one mini-batch.

    ``ranks``: each DP rank's sample lengths. The planner and the padded shapes are the actor's.
    """
    count = max(len(token_budget_micro_batches(rows, shape.budget)) for rows in ranks)
    plans = [token_budget_micro_batches(rows, shape.budget, min_num_micro_batches=count) for rows in ranks]
    multiple = padded_sequence_multiple(tp=shape.tp, fp8_recipe=shape.fp8_recipe)
    seq = -(-max(max(rows) for rows in ranks) // multiple) * multiple
    rows_per_micro_batch = max(len(part) for plan in plans for part in plan)
    rule = packing_rule(tp=shape.tp, cp=1, sequence_parallel=shape.sequence_parallel, fp8_recipe=shape.fp8_recipe)
    packed = 0
    for rows, plan in zip(ranks, plans, strict=True):
        layouts = plan_micro_batch_packing([[rows[i] for i in part] for part in plan], seq, rule)
        packed += sum(layout.total for layout in layouts)
    real = sum(sum(rows) for rows in ranks)
    return count, real, packed, len(ranks) * count * rows_per_micro_batch * seq


@dataclass
class Tally:
    """One method's figures over every mini-batch of every seed."""

    tokens: list[float]
    workload: list[float]
    micro_batches: list[int]
    real: int = 0
    packed: int = 0
    padded: int = 0

    def row(self) -> list[str]:
        """The table's figures; "-" for the micro-batch columns of a tally without them (the bound)."""
        imbalances = [f"{f(values):.4f}" for values in (self.tokens, self.workload) for f in (max, np.mean)]
        if not self.real:
            return [*imbalances, "-", "-", "-"]
        return [
            *imbalances,
            f"{np.mean(self.micro_batches):.2f}",
            f"{(self.packed - self.real) / self.real:.3f}",
            f"{(self.padded - self.real) / self.real:.2f}",
        ]


def measure(shape: Shape, seeds: int) -> tuple[dict[str, Tally], Tally]:
    """Each method's tally, and the equal-count bound's (tokens and workload only)."""
    tallies, bound = {name: Tally([], [], []) for name in METHODS}, Tally([], [], [])
    size = shape.prompts * shape.group_size // shape.mini_batches
    for seed in range(seeds):
        lengths = step_lengths(shape, seed)
        for start in range(0, len(lengths), size):
            mini_batch = lengths[start : start + size]
            workloads = [sequence_workload(length) for length in mini_batch]
            bound.tokens.append(equal_count_bound(mini_batch, shape.dp))
            bound.workload.append(equal_count_bound(workloads, shape.dp))
            for name, split in METHODS.items():
                parts, tally = split(mini_batch, shape.dp), tallies[name]
                tally.tokens.append(imbalance(parts, mini_batch))
                tally.workload.append(imbalance(parts, workloads))
                count, real, packed, padded = padding(shape, [[mini_batch[i] for i in part] for part in parts])
                tally.micro_batches.append(count)
                tally.real, tally.packed, tally.padded = tally.real + real, tally.packed + packed, tally.padded + padded
    return tallies, bound


COLUMNS = (
    "shape", "samples/rank/mb", "method", "tokens worst", "tokens mean", "workload worst", "workload mean",
    "micro-batches", "pad/real packed", "pad/real padded",
)  # fmt: skip


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(str(row[i])) for row in [list(COLUMNS), *rows]) for i in range(len(COLUMNS))]
    print(" | ".join(f"{c:>{w}}" for c, w in zip(COLUMNS, widths, strict=True)))
    for row in rows:
        print(" | ".join(f"{c:>{w}}" for c, w in zip(row, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipe paths")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--limits", default="128,64", help="fewer prompts per step for the first recipe")
    args = parser.parse_args()
    recipes = args.recipes.split(",")
    own = [recipe_shape(path) for path in recipes]
    limits = [recipe_shape(recipes[0], int(n)) for n in args.limits.split(",") if n]
    rows, results = [], {}
    for shape in own + limits:
        print(f"# {shape}")
        results[shape.name], bound = measure(shape, args.seeds)
        rows += [[shape.name, str(shape.per_rank), name, *tally.row()] for name, tally in results[shape.name].items()]
        rows.append([shape.name, str(shape.per_rank), "bound, any equal-count split", *bound.row()])
    print(
        f"# {args.seeds} seeds; responses log-normal (per-prompt difficulty sigma {DIFFICULTY_SIGMA}, "
        f"sigma {RESPONSE_SIGMA}) plus {TRUNCATED_MASS:.0%} cut at the maximum"
    )
    print_table(rows)
    ours = max(max(results[shape.name]["ours"].tokens) for shape in own)
    baseline = max(max(results[shape.name]["naive"].tokens) for shape in own)
    print(
        f"worst DP token imbalance (max/mean per rank) over the recipes' shapes: ours {ours:.4f}, naive {baseline:.4f}; "
        f"ratio ours/naive = {ours / baseline:.3f}"
    )


if __name__ == "__main__":
    main()
