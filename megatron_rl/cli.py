"""The `megatron-rl` command: one subcommand per job, each in a small function."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from megatron_rl.config import RecipeError, RunConfig, load_recipe, recipe_to_yaml, trainer_layout


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
    try:
        cfg, warnings = load_recipe(args.recipe, args.overrides)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(_layout_summary(cfg))
    print(recipe_to_yaml(cfg), end="")
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `megatron-rl` console command; returns the exit status."""
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
