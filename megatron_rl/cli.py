"""The `megatron-rl` command: one subcommand per job, each in a small function."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from megatron_rl.config import RecipeError, RunConfig, load_recipe, read_model_shape, recipe_to_yaml, trainer_layout


def _layout_summary(cfg: RunConfig) -> str:
    par, rollout, train = cfg.parallel, cfg.rollout, cfg.train
    layout = trainer_layout(par, cfg.cluster, rollout)
    responses = train.prompts_per_step * rollout.n_samples_per_prompt
    per_rank = responses // train.mini_batches_per_step // layout.dp
    device = "CPU" if cfg.cluster.gpus_per_node == 0 else f"{cfg.cluster.nodes} x {cfg.cluster.gpus_per_node} GPU"
    return "\n".join(
        [
            f"# trainer: {layout.world_size} ranks ({device}) = tp {par.tp} x pp {par.pp} x cp {par.cp} x dp {layout.dp}"
            f"; experts: etp {par.expert_tp} x ep {par.ep} x pp {par.pp} x expert-dp {layout.expert_dp}",
            f"# step: {train.prompts_per_step} prompts x {rollout.n_samples_per_prompt} samples = {responses} responses"
            f", {train.mini_batches_per_step} mini-batch(es) x {train.ppo_epochs} epoch(s)"
            f", {per_rank} responses per rank per mini-batch",
            f"# rollout: {rollout.engine} engines (tp {rollout.tp}, ep {rollout.ep}, dp {rollout.dp}), {rollout.placement}",
        ]
    )


def _cmd_validate(args: argparse.Namespace) -> int:
    from megatron_rl.data.preparation import resolve_reward

    try:
        cfg, warnings = load_recipe(args.recipe, args.overrides)
        resolve_reward(cfg.data)
    except (RecipeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(_layout_summary(cfg))
    print(recipe_to_yaml(cfg), end="")
    return 0


def _cmd_prepare(args: argparse.Namespace) -> int:
    from megatron_rl.data.preparation import prepare_data
    from megatron_rl.data.sampler import PromptSampler

    try:
        cfg, _ = load_recipe(args.recipe, args.overrides)
        shape = read_model_shape(cfg.model.path, cfg.model.random_init)
        prepared = prepare_data(
            cfg.data,
            tokenizer_path=cfg.model.tokenizer or cfg.model.path,
            model_vocab_size=shape.vocab_size,
            max_prompt_length=cfg.rollout.max_prompt_length,
            work_dir=f"{cfg.run_dir}/data",
        )
    except (RecipeError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"# tokenizer: {prepared.tokenizer_dir} ({len(prepared.tokenizer)} tokens, model vocab {shape.vocab_size})")
    for split, dataset in (("train", prepared.train), ("val", prepared.val)):
        if dataset is not None:
            lengths = [len(item.prompt_ids) for item in dataset]
            print(
                f"# {split}: {len(dataset)} prompts, {dataset.num_filtered} filtered as longer than "
                f"{cfg.rollout.max_prompt_length} tokens; prompt tokens min {min(lengths)} "
                f"mean {sum(lengths) / len(lengths):.1f} max {max(lengths)}"
            )
    reward = prepared.reward_fn
    print(f"# reward: {cfg.data.reward} -> {reward.__module__}.{reward.__qualname__}")
    sampler = PromptSampler(len(prepared.train), cfg.train.prompts_per_step, seed=cfg.train.seed, shuffle=cfg.data.shuffle)
    print(f"# first step: {cfg.train.prompts_per_step} prompts x {cfg.rollout.n_samples_per_prompt} samples")
    for index in sampler.next_batch():
        item = prepared.train[index]
        prompt = prepared.tokenizer.decode(item.prompt_ids, skip_special_tokens=False)
        print(f"  [{index}] {prompt!r} -> {item.ground_truth!r}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="megatron-rl", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    validate = commands.add_parser(
        "validate", help="check a recipe and print it resolved (defaults filled in), or list its errors"
    )
    validate.add_argument("recipe", help="recipe YAML file")
    validate.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-6")
    validate.set_defaults(handler=_cmd_validate)

    prepare = commands.add_parser(
        "prepare", help="prepare a recipe's data (tokenizer, datasets, reward) and show the first step's prompts"
    )
    prepare.add_argument("recipe", help="recipe YAML file")
    prepare.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.synthetic.task=max")
    prepare.set_defaults(handler=_cmd_prepare)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `megatron-rl` console command; returns the exit status."""
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
