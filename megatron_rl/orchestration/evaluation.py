"""``megatron-rl eval``: a checkpoint's validation sets through the recipe's engines alone, no trainer rank.

Output, under ``out_dir``: ``<set>.jsonl`` (one row per response: prompt index, set, sample index, response
text, score, correct, answer), ``<set>.json`` (the set's metrics, written last: a set that has one is done
and skipped when the evaluation runs again), and ``results.json`` / ``results.md``, the table of every set.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.checkpoint.commit import latest_checkpoint
from megatron_rl.checkpoint.layout import HF_EXPORT_DIR, TRAINER_STATE_FILE, model_weight_dirs
from megatron_rl.checkpoint.trainer_state import load_trainer_state
from megatron_rl.config import RunConfig, read_architecture
from megatron_rl.config.model_source import has_hf_config
from megatron_rl.data.preparation import PreparedData, prepare_recipe_data
from megatron_rl.orchestration.judge_engines import start_judge_engines
from megatron_rl.orchestration.network import RunNetwork
from megatron_rl.orchestration.placement_group import create_rank_slots
from megatron_rl.orchestration.resources import (
    RunResources,
    prepare_rollout_weights,
    served_reward,
    start_engines,
    start_ray,
)
from megatron_rl.orchestration.validation import ValidationSet, build_validation_sets
from megatron_rl.plan.placement import plan_run_placement
from megatron_rl.rollout.episodes import build_episode
from megatron_rl.rollout.groups import RolloutGroup


@dataclass(frozen=True)
class EvalSetResult:
    """One set's metrics (``mean@n``, ``pass@k``, ... without the ``val/<set>/`` prefix) and whether this call ran it
    (False: read back from an earlier call's ``<set>.json``)."""

    name: str
    metrics: dict[str, float]
    ran: bool


def hf_weights_of(checkpoint: Path, out_dir: Path) -> Path:
    """A Hugging Face model directory of ``checkpoint``: the directory itself when it is one, a run checkpoint's
    ``hf/`` export, else ``out_dir/hf`` converted from its torch_dist weights once (``convert mcore-to-hf``; local
    gloo ranks, no trainer). A run's checkpoint root means its ``latest``."""
    if has_hf_config(str(checkpoint)):
        return checkpoint
    weights, metadata = model_weight_dirs(checkpoint)
    if (weights.parent / HF_EXPORT_DIR / "config.json").is_file():
        return weights.parent / HF_EXPORT_DIR
    target = out_dir / "hf"
    if not (target / "config.json").is_file():
        from megatron_rl.checkpoint.convert import convert_mcore_to_hf, saved_lora_config

        print(f"# eval: converting {weights} into {target} (torch_dist -> Hugging Face)", flush=True)
        # a LoRA run's checkpoint: its merged model
        convert_mcore_to_hf(weights, target, metadata_dir=metadata, lora=saved_lora_config(weights, metadata))
    return target


def checkpoint_step(checkpoint: Path) -> int:
    """The training step a run checkpoint (or a run's checkpoint folder: its latest) was saved after; 0 for a
    Hugging Face directory that is no run checkpoint."""
    if (latest := latest_checkpoint(checkpoint)) is not None:
        checkpoint = latest
    if not (checkpoint / TRAINER_STATE_FILE).is_file() and has_hf_config(str(checkpoint)):
        return 0
    return load_trainer_state(checkpoint).step


def evaluate(
    cfg: RunConfig, weights: Path, out_dir: Path, names: Sequence[str], *, step: int = 0
) -> list[EvalSetResult]:
    """Run the validation sets ``names`` of ``cfg`` on engines serving the Hugging Face model in ``weights``; write
    each set's responses and metrics under ``out_dir`` (see the module docstring) and return them in order.

    Each set is sampled as a run validates it after ``step`` (:meth:`ValidationSet.generate`), so ``eval`` of a
    run's checkpoint draws the samples that run drew at that step.

    Sets already done there are read back, not run. Raises ValueError for a set the recipe does not define or one
    without prompts, before any engine starts.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    arch = read_architecture(cfg.model.path, cfg.model.random_init)
    data = prepare_recipe_data(cfg, model_vocab_size=arch.vocab_size, work_dir=f"{cfg.run_dir}/data")
    for name in names:
        if name not in cfg.validation.sets or name not in data.val_sets:
            build_validation_sets(cfg, data, [], names=[name])  # raises, naming the set and the fix
    todo = [name for name in names if not (out_dir / f"{name}.json").is_file()]
    ran = _run_sets(cfg, data, weights, out_dir, todo, step) if todo else {}
    results = [
        EvalSetResult(
            name, ran[name] if name in ran else json.loads((out_dir / f"{name}.json").read_text()), name in ran
        )
        for name in names
    ]
    _write_table(results, out_dir, cfg, weights)
    return results


def _run_sets(
    cfg: RunConfig, data: PreparedData, weights: Path, out_dir: Path, names: Sequence[str], step: int
) -> dict[str, dict[str, float]]:
    network = RunNetwork.of_run(cfg)
    run = RunResources(cfg, data, weights, network=network)
    try:
        start_ray(cfg, network)
        run.judge = start_judge_engines(cfg, network, run.api_key)
        plan = plan_run_placement(cfg)
        run.placement, slots = create_rank_slots(
            plan.num_bundles,
            num_gpus=plan.bundle.num_gpus,
            num_cpus=plan.bundle.num_cpus,
            name=f"{cfg.name}-eval",
            on_this_node=network.is_loopback,
        )
        run.engine_hosts = start_engines(
            cfg, prepare_rollout_weights(cfg, weights), run.placement, slots, plan, network
        )
        run.engine_hosts.wait_healthy()
        run.engines = list(run.engine_hosts.clients)
        run.episode = build_episode(cfg.rollout, data.tokenizer)
        run.validation = build_validation_sets(
            cfg, data, run.engines, names=names, episode=run.episode, served_reward=served_reward(cfg, run.judge)
        )
        done = {}
        for validation_set in run.validation:  # the manager shows a progress bar of prompts on a terminal
            print(f"# eval: set {validation_set.name} ({len(data.val_sets[validation_set.name])} prompts)", flush=True)
            done[validation_set.name] = _run_set(validation_set, data, out_dir, step)
        return done
    finally:
        run.close()


def _run_set(validation_set: ValidationSet, data: PreparedData, out_dir: Path, step: int) -> dict[str, float]:
    """Generate and score one set as after ``step``; its JSONL, then its metrics file (the mark that it is done)."""
    name = validation_set.name
    generated = validation_set.generate(step)
    prefix = f"val/{name}/"
    metrics = {key.removeprefix(prefix): value for key, value in validation_set.metrics_of(generated).items()}
    _write_atomically(out_dir / f"{name}.jsonl", "".join(_rows(name, generated.groups, data)))
    _write_atomically(out_dir / f"{name}.json", json.dumps(metrics, indent=1) + "\n")
    return metrics


def _rows(name: str, groups: Sequence[RolloutGroup], data: PreparedData) -> list[str]:
    rows = []
    for group in sorted(groups, key=lambda group: group.prompt_index):
        for index, sample in enumerate(group.samples):
            row = {
                "prompt_index": group.prompt_index,
                "set": name,
                "sample": index,
                "response": data.decode(sample.response_ids),
                "score": sample.score,
                "correct": sample.correct,
                "answer": sample.answer,
                "finish_reason": sample.finish_reason,
                "reward_failure": sample.reward_failure,
            }
            rows.append(json.dumps(row) + "\n")
    return rows


def _write_table(results: Sequence[EvalSetResult], out_dir: Path, cfg: RunConfig, weights: Path) -> None:
    """``results.json`` and ``results.md``: one row per set, its sampling and its metrics."""
    record = {
        "recipe": cfg.name,
        "weights": str(weights),
        "sets": {
            result.name: {
                "sampling": cfg.validation.sets[result.name].model_dump(mode="json"),
                "metrics": result.metrics,
            }
            for result in results
        },
    }
    _write_atomically(out_dir / "results.json", json.dumps(record, indent=1) + "\n")
    _write_atomically(out_dir / "results.md", format_table(results, cfg))


def format_table(results: Sequence[EvalSetResult], cfg: RunConfig) -> str:
    """A Markdown table: each set, its n, temperature and top_p, then mean@n and each pass@k / maj@k it reports."""
    columns = list(dict.fromkeys(key for result in results for key in result.metrics if "@" in key))
    lines = [
        "| set | n | temperature | top_p | " + " | ".join(columns) + " |",
        "| --- | --- | --- | --- | " + " | ".join("---" for _ in columns) + " |",
    ]
    for result in results:
        sampling = cfg.validation.sets[result.name]
        values = [f"{result.metrics[key]:.4f}" if key in result.metrics else "" for key in columns]
        lines.append(
            f"| {result.name} | {sampling.n} | {sampling.temperature:g} | {sampling.top_p:g} | "
            + " | ".join(values)
            + " |"
        )
    return "\n".join(lines) + "\n"


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a kill mid-write leaves the old file or none)."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)
