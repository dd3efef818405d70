"""The `megatron-rl` command: one subcommand per job, each in a small function."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rl.engines.engine import EngineError
from megatron_rl.orchestration.errors import (
    AsyncEngineCrashError,
    EngineRestartLimitError,
    NonFiniteTrainingError,
    RankCallError,
)
from megatron_rl.parallel.errors import RankFailedError
from megatron_rl.plan.placement import PlacementError

if TYPE_CHECKING:
    from megatron_rl.parallel.distributed import ParallelSizes
from megatron_rl.config import (
    RecipeError,
    RunConfig,
    engine_layout,
    load_recipe,
    read_architecture,
    recipe_to_yaml,
    trainer_layout,
)


def _judge_summary(cfg: RunConfig) -> list[str]:
    if cfg.judge is None:
        return []
    engine = cfg.judge.engine or cfg.rollout.engine
    where = f", {cfg.judge_nodes} node(s) of its own (job: {cfg.job_nodes} nodes)" if cfg.judge_nodes else ""
    return [f"# judge: {cfg.judge.num_engines} {engine} engine(s) (tp {cfg.judge.tp}) of {cfg.judge.model}{where}"]


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
            f"# rollout: {engine_layout(cfg.cluster, rollout).num_engines} {rollout.engine} engine(s) "
            f"(tp {rollout.tp}, ep {rollout.ep}, dp {rollout.dp}), {rollout.placement}",
            *_judge_summary(cfg),
        ]
    )


def _cmd_validate(args: argparse.Namespace) -> int:
    from megatron_rl.config.schema import REMOTE_REWARD
    from megatron_rl.data.preparation import resolve_reward
    from megatron_rl.rollout.episodes import check_episode

    try:
        cfg, warnings = load_recipe(args.recipe, args.overrides, require_files=args.strict)
        machine_problems = check_episode(cfg.rollout)
        if cfg.data.reward != REMOTE_REWARD:
            resolve_reward(cfg.data)
    except (RecipeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if cfg.data.reward == REMOTE_REWARD:
        try:  # a reward server this machine cannot reach (a login node) may still serve the job: needed before training
            resolve_reward(cfg.data)
        except ValueError as exc:
            machine_problems.append(f"{exc}: needed before training")
    if args.strict and machine_problems:
        for problem in machine_problems:
            print(f"error: {problem}", file=sys.stderr)
        return 1
    for warning in [*warnings, *machine_problems]:
        print(f"warning: {warning}", file=sys.stderr)
    print(_layout_summary(cfg))
    print(recipe_to_yaml(cfg), end="")
    return 0


def _cmd_prepare(args: argparse.Namespace) -> int:
    from megatron_rl.data.preparation import prepare_recipe_data
    from megatron_rl.data.sampler import PromptSampler
    from megatron_rl.named_functions import qualified_name

    try:
        cfg, _ = load_recipe(args.recipe, args.overrides)
        arch = read_architecture(cfg.model.path, cfg.model.random_init)
        prepared = prepare_recipe_data(cfg, model_vocab_size=arch.vocab_size, work_dir=f"{cfg.run_dir}/data")
    except (RecipeError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"# tokenizer: {prepared.tokenizer_dir} ({len(prepared.tokenizer)} tokens, model vocab {arch.vocab_size})")
    splits = [
        ("train", prepared.train),
        *((f"validation set {name}", data) for name, data in prepared.val_sets.items()),
    ]
    for split, dataset in splits:
        if dataset is not None:
            lengths = [len(item.prompt_ids) for item in dataset]
            print(
                f"# {split}: {len(dataset)} prompts, {dataset.num_filtered} filtered as longer than "
                f"{cfg.rollout.max_prompt_length} tokens; prompt tokens min {min(lengths)} "
                f"mean {sum(lengths) / len(lengths):.1f} max {max(lengths)}"
            )
    reward = prepared.reward_fn
    scorer = qualified_name(reward) if reward is not None else f"the judge model {cfg.judge and cfg.judge.model}"
    print(f"# reward: {cfg.data.reward} -> {scorer}")
    sampler = PromptSampler(
        len(prepared.train), cfg.train.prompts_per_step, seed=cfg.train.seed, shuffle=cfg.data.shuffle
    )
    print(f"# first step: {cfg.train.prompts_per_step} prompts x {cfg.rollout.n_samples_per_prompt} samples")
    for index in sampler.next_batch():
        item = prepared.train[index]
        prompt = prepared.tokenizer.decode(item.prompt_ids, skip_special_tokens=False)
        print(f"  [{index}] {prompt!r} -> {item.ground_truth!r}")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    """Exit 0 when the layout fits the GPUs, 1 when it does not, the recipe is invalid or ``--rates`` is no
    preflight report."""
    from megatron_rl.plan.estimates import ASSUMED, with_measured
    from megatron_rl.plan.memory import plan_memory
    from megatron_rl.plan.placement import plan_run_placement
    from megatron_rl.plan.rates import read_report
    from megatron_rl.plan.report import render_plan

    try:
        cfg, _ = load_recipe(args.recipe, args.overrides, require_files=False)
        arch = read_architecture(cfg.model.path, cfg.model.random_init, cfg.model.config_fallback)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    assumptions = ASSUMED
    if args.rates is not None:
        try:
            report = read_report(args.rates)
        except ValueError as exc:  # names the file
            print(f"error: {exc}", file=sys.stderr)
            return 1
        dated = f" ({report.date})" if report.date else ""
        assumptions = with_measured(report.rates, f"{args.rates}{dated}")
    plan = plan_memory(cfg, arch, args.gpu_memory_gib)
    placement = plan_run_placement(cfg)
    rates = f" --rates {args.rates}" if args.rates is not None else ""
    print(f"# megatron-rl plan {args.recipe} {' '.join(args.overrides)}".rstrip() + rates)
    positions = placement.trainer_positions, placement.engine_positions
    print(render_plan(cfg, arch, plan, *positions, assumptions=assumptions))
    return 1 if plan.problems else 0


def _cmd_train(args: argparse.Namespace) -> int:
    from megatron_rl.orchestration.driver import refuse_unbuilt, train
    from megatron_rl.rollout.episodes import check_episode

    try:
        cfg, warnings = load_recipe(args.recipe, args.overrides)
        refuse_unbuilt(cfg)
        machine_problems = check_episode(cfg.rollout)  # before any GPU or Ray: a tool that cannot run here
    except (RecipeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if machine_problems:
        for problem in machine_problems:
            print(f"error: {problem}", file=sys.stderr)
        return 1
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    _silence_library_warnings()
    print(_layout_summary(cfg), flush=True)
    end = train(cfg)
    where = f"metrics {cfg.log_dir}/metrics.jsonl; checkpoints {end.checkpoint_dir}"
    if end.last_step < cfg.train.steps:
        print(f"# stopped early: {end.last_step} of {cfg.train.steps} steps; {where}; the same command resumes")
    else:
        print(f"# done: {cfg.train.steps} steps; {where}")
    return 0


def _cmd_smoke(args: argparse.Namespace) -> int:
    """Step 1 of the shrunk recipe, then a resume to step 2; exit 0 when both ran."""
    import shutil

    from megatron_rl.config.smoke import SMOKE_STEPS, generated_data_paths, smoke_recipe
    from megatron_rl.data.synthetic_task import TOOL_TASKS, write_synthetic_dataset
    from megatron_rl.data.synthetic_tokenizer import save_synthetic_tokenizer
    from megatron_rl.orchestration.driver import train

    try:
        cfg, _ = load_recipe(args.recipe, args.overrides, require_files=False)
        arch = read_architecture(cfg.model.path, cfg.model.random_init, cfg.model.config_fallback)
        changes = smoke_recipe(cfg, arch)
        shutil.rmtree(f"runs/smoke-{cfg.name}", ignore_errors=True)
        generated = generated_data_paths(cfg)
        if generated is not None:
            save_synthetic_tokenizer(generated.tokenizer_dir, tools=generated.task in TOOL_TASKS)
            write_synthetic_dataset(
                Path(generated.train_file).parent, task=generated.task, prompt_format="chat", num_train=256, num_val=8
            )
        overrides = [*args.overrides, *(change.override for change in changes)]
        smoke, warnings = load_recipe(args.recipe, overrides)
        first, _ = load_recipe(args.recipe, [*overrides, "train.steps=1"])
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"# smoke: {args.recipe} {' '.join(args.overrides)}".rstrip())
    for change in changes:
        print(f"# smoke: {change}")
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    _silence_library_warnings()
    print(_layout_summary(smoke), flush=True)
    end = train(first)
    if end.last_step == 1:  # below 1: a signal stopped it, and there is nothing to resume from
        print(f"# smoke: resuming from step 1 to step {SMOKE_STEPS}", flush=True)
        end = train(smoke)
    if end.last_step < SMOKE_STEPS:
        print(f"error: smoke stopped by a signal after step {end.last_step} of {SMOKE_STEPS}", file=sys.stderr)
        return 1
    print(f"# smoke passed: {SMOKE_STEPS} steps with a resume; metrics {smoke.log_dir}/metrics.jsonl")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    """Exit 0 when every set ran (or was done before); the table goes to stdout and the output folder."""
    from megatron_rl.orchestration.evaluation import checkpoint_step, evaluate, format_table, hf_weights_of

    try:
        cfg, warnings = load_recipe(args.recipe, args.overrides)
        names = args.sets or list(cfg.validation.sets)
        unknown = [name for name in names if name not in cfg.validation.sets]
        if unknown:
            raise ValueError(f"--sets: {unknown} not in the recipe's validation.sets {list(cfg.validation.sets)}")
    except (RecipeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    source = Path(args.checkpoint or args.hf)
    if not source.exists():
        print(f"error: {'--checkpoint' if args.checkpoint else '--hf'}: no such directory {source}", file=sys.stderr)
        return 1
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    _silence_library_warnings()
    out_dir = Path(args.out) if args.out else Path(cfg.run_dir) / "eval" / source.resolve().name
    if cfg.rollout.quantization == "fp8":  # the engines serve these weights, not the run's initial FP8 conversion
        cfg = cfg.model_copy(
            update={"rollout": cfg.rollout.model_copy(update={"fp8_checkpoint": str(out_dir / "fp8")})}
        )
    step = checkpoint_step(source) if args.checkpoint else 0
    results = evaluate(cfg, hf_weights_of(source, out_dir), out_dir, names, step=step)
    print(format_table(results, cfg), end="")
    done_before = [result.name for result in results if not result.ran]
    if done_before:
        print(f"# eval: {', '.join(done_before)} done before, read back from {out_dir}")
    print(f"# eval: {out_dir}/results.md, results.json; responses in {out_dir}/<set>.jsonl")
    return 0


def _cmd_preflight(args: argparse.Namespace) -> int:
    """Exit 0 when every step passed, 1 when one failed (the report names it and the steps not reached)."""
    try:
        # Files the recipe reads are checked by the inputs step, which names what is wrong with them.
        cfg, warnings = load_recipe(args.recipe, args.overrides, require_files=False)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.dry_run:
        from megatron_rl.preflight.dry_run import describe_steps

        _silence_library_warnings()
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime" on a login node
        print(f"# preflight {args.recipe} {' '.join(args.overrides)} (dry run: nothing started)".rstrip())
        print(_layout_summary(cfg))
        print("\n".join(describe_steps(cfg)))
        return 0
    from megatron_rl.preflight.inputs import preflight_dir
    from megatron_rl.preflight.runner import run_preflight

    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    _silence_library_warnings()
    print(f"# preflight {args.recipe} {' '.join(args.overrides)}".rstrip(), flush=True)
    print(_layout_summary(cfg), flush=True)
    report = run_preflight(cfg, args.recipe, args.overrides, echo=lambda line: print(line, flush=True))
    where = preflight_dir(cfg)
    if report.passed:
        print(
            f"# preflight passed; report {where}/report.md; `megatron-rl plan {args.recipe} --rates "
            f"{where}/report.json` uses its rates"
        )
        return 0
    print(f"# preflight FAILED; not reached: {', '.join(report.not_reached) or '-'}; report {where}/report.md")
    return 1


def _cmd_sandbox_server(args: argparse.Namespace) -> int:
    """Serve until stopped; exit 1 before listening when there is no API key or the sandbox cannot run here."""
    import os

    from megatron_rl.rollout.sandbox_server import build_server, read_api_key
    from megatron_rl.tools.sandbox import sandbox_problem

    try:
        api_key = read_api_key(args.api_key_file, dict(os.environ))
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    problem = sandbox_problem()
    if problem is not None:
        print(f"error: the sandbox cannot run on this machine, so it cannot serve it: {problem}", file=sys.stderr)
        return 1
    server = build_server(args.host, args.port, args.workers, api_key)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s sandbox-server %(levelname)s %(message)s")
    address = f"http://{args.host}:{server.server_port}"
    print(f"# sandbox-server: {address} ({args.workers} workers; POST /run_code, GET /health)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _parallel_sizes(args: argparse.Namespace) -> ParallelSizes:
    from megatron_rl.parallel.distributed import ParallelSizes

    return ParallelSizes(tp=args.tp, pp=args.pp, vpp=args.vpp, cp=args.cp, ep=args.ep, etp=args.etp)


def _silence_library_warnings() -> None:
    """Hide Megatron's and torch.distributed's start-up notices (no apex, deprecations); `python -W` overrides."""
    if sys.warnoptions:
        return
    for module in (r"megatron\.", r"torch\.distributed\."):
        warnings.filterwarnings("ignore", module=module)


def _cmd_hf_to_mcore(args: argparse.Namespace) -> int:
    from megatron_rl.checkpoint.convert import convert_hf_to_mcore

    convert_hf_to_mcore(args.hf, args.out, _parallel_sizes(args))
    return 0


def _cmd_mcore_to_hf(args: argparse.Namespace) -> int:
    from megatron_rl.checkpoint.convert import convert_mcore_to_hf, saved_lora_config
    from megatron_rl.checkpoint.layout import model_weight_dirs

    weights, metadata = model_weight_dirs(args.ckpt)
    lora = saved_lora_config(weights, metadata)
    convert_mcore_to_hf(weights, args.out, _parallel_sizes(args), metadata_dir=metadata, lora=lora)
    return 0


def _cmd_hf_to_fp8(args: argparse.Namespace) -> int:
    from megatron_rl.checkpoint.fp8_convert import convert_hf_to_fp8

    print(f"# wrote {convert_hf_to_fp8(args.hf, args.out, tuple(args.block))}")
    return 0


def _cmd_check_parity(args: argparse.Namespace) -> int:
    from megatron_rl.models.parity import check_parity

    return 0 if check_parity(args.hf, _parallel_sizes(args), tolerance=args.tolerance) else 1


def _add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    for name in ("tp", "pp", "cp", "ep"):
        parser.add_argument(f"--{name}", type=int, default=1, help=f"{name.upper()} size")
    parser.add_argument("--etp", type=int, default=None, help="expert TP size (default: --tp)")
    parser.add_argument("--vpp", type=int, default=None, help="virtual pipeline chunks per stage")


def _add_checkpoint_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    convert = commands.add_parser(
        "convert", help="convert between Hugging Face and Megatron checkpoints, or into FP8 for the engines"
    )
    directions = convert.add_subparsers(dest="direction", required=True)
    to_mcore = directions.add_parser("hf-to-mcore", help="HF safetensors -> Megatron torch_dist")
    to_mcore.add_argument("--hf", required=True, type=Path, help="Hugging Face model directory")
    to_mcore.add_argument("--out", required=True, type=Path, help="new checkpoint directory")
    _add_layout_arguments(to_mcore)
    to_mcore.set_defaults(handler=_cmd_hf_to_mcore)
    to_hf = directions.add_parser("mcore-to-hf", help="Megatron torch_dist -> HF safetensors")
    to_hf.add_argument(
        "--ckpt",
        required=True,
        type=Path,
        help="directory written by hf-to-mcore, a run checkpoint, or a run's checkpoint dir (converts its latest)",
    )
    to_hf.add_argument("--out", required=True, type=Path, help="new Hugging Face model directory")
    _add_layout_arguments(to_hf)
    to_hf.set_defaults(handler=_cmd_mcore_to_hf)
    to_fp8 = directions.add_parser(
        "hf-to-fp8", help="HF safetensors -> blockwise FP8 (e4m3 + weight_scale_inv), what FP8 rollouts start from"
    )
    to_fp8.add_argument("--hf", required=True, type=Path, help="Hugging Face model directory (not quantised)")
    to_fp8.add_argument("--out", required=True, type=Path, help="new Hugging Face model directory")
    to_fp8.add_argument(
        "--block", type=int, nargs=2, default=[128, 128], metavar=("ROWS", "COLS"), help="scale block (default 128 128)"
    )
    to_fp8.set_defaults(handler=_cmd_hf_to_fp8)
    parity = commands.add_parser(
        "check-parity", help="compare Megatron at a layout with transformers on a checkpoint (fp32, CPU ranks)"
    )
    parity.add_argument("--hf", required=True, type=Path, help="Hugging Face model directory")
    parity.add_argument("--tolerance", type=float, default=1e-4, help="max |diff| allowed (fp32)")
    _add_layout_arguments(parity)
    parity.set_defaults(handler=_cmd_check_parity)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="megatron-rl", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    validate = commands.add_parser(
        "validate", help="check a recipe and print it resolved (defaults filled in), or list its errors"
    )
    validate.add_argument("recipe", help="recipe YAML file")
    validate.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-6")
    validate.add_argument(
        "--strict",
        action="store_true",
        help="also refuse files the recipe reads that are not here (weights, data), as `train` does",
    )
    validate.set_defaults(handler=_cmd_validate)

    prepare = commands.add_parser(
        "prepare", help="prepare a recipe's data (tokenizer, datasets, reward) and show the first step's prompts"
    )
    prepare.add_argument("recipe", help="recipe YAML file")
    prepare.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.synthetic.task=max")
    prepare.set_defaults(handler=_cmd_prepare)

    plan = commands.add_parser(
        "plan", help="parameters and memory per GPU of a recipe's layout, engines' KV cache and placement (no GPU)"
    )
    plan.add_argument("recipe", help="recipe YAML file")
    plan.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.ep=4")
    plan.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of one GPU in GiB (default 80)")
    plan.add_argument(
        "--rates",
        type=Path,
        metavar="REPORT.json",
        help="a `megatron-rl preflight` report.json: its measured rates replace the assumed ones in the estimates",
    )
    plan.set_defaults(handler=_cmd_plan)

    train = commands.add_parser(
        "train", help="run a recipe's RL job (resumes from the latest checkpoint of its run directory)"
    )
    train.add_argument("recipe", help="recipe YAML file")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=4")
    train.set_defaults(handler=_cmd_train)

    smoke = commands.add_parser(
        "smoke",
        help="run a recipe's own settings for 2 steps on CPU (toy model of its architecture, its kinds of "
        "parallelism on <= 4 ranks, reference engine, fp32, generated prompts when its data is absent)",
    )
    smoke.add_argument("recipe", help="recipe YAML file")
    smoke.add_argument("overrides", nargs="*", help="dotted overrides applied before shrinking")
    smoke.set_defaults(handler=_cmd_smoke)

    evaluation = commands.add_parser(
        "eval",
        help="run a checkpoint's validation sets (mean@n, pass@k, maj@k per set) on the recipe's engines only, "
        "no trainer ranks; a set already done in the output folder is skipped",
    )
    evaluation.add_argument("recipe", help="recipe YAML file (its validation sets, engines and reward)")
    evaluation.add_argument("overrides", nargs="*", help="dotted overrides, e.g. validation.sets.aime24.n=32")
    weights = evaluation.add_mutually_exclusive_group(required=True)
    weights.add_argument(
        "--checkpoint",
        help="a run checkpoint (step_*, or a checkpoint folder: its latest); converted when it has no hf/",
    )
    weights.add_argument("--hf", help="a Hugging Face model directory")
    evaluation.add_argument("--sets", nargs="+", help="the sets to run (default: every set of the recipe)")
    evaluation.add_argument("--out", help="output folder (default: runs/<name>/eval/<checkpoint folder name>)")
    evaluation.set_defaults(handler=_cmd_eval)

    preflight = commands.add_parser(
        "preflight",
        help="on the allocation: every path the recipe uses, step by step at its own layout (install, inputs, "
        "GPUs and network, trainer and engines on the model cut to a few layers, storage), with a report",
    )
    preflight.add_argument("recipe", help="recipe YAML file")
    preflight.add_argument("overrides", nargs="*", help="dotted overrides, e.g. cluster.nodes=2")
    preflight.add_argument(
        "--dry-run", action="store_true", help="print the steps and the ranks, nodes and GPUs each uses; start nothing"
    )
    preflight.set_defaults(handler=_cmd_preflight)

    sandbox = commands.add_parser(
        "sandbox-server",
        help="serve the python tool's sandbox over HTTP (SandboxFusion's POST /run_code) for nodes where it "
        "cannot run; recipes point rollout.tool_sandbox.url at it",
    )
    sandbox.add_argument("--host", default="127.0.0.1", help="the one address to listen on (no wildcard)")
    sandbox.add_argument("--port", type=int, default=8080, help="port (0: any free one, printed at start)")
    sandbox.add_argument("--workers", type=int, default=4, help="sandboxes run at once; more requests wait")
    sandbox.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help="file holding the API key requests must send (default: $MEGATRON_RL_ENGINE_API_KEY)",
    )
    sandbox.set_defaults(handler=_cmd_sandbox_server)

    _add_checkpoint_commands(commands)
    return parser


QUIET_ON_CLOSED_PIPE = frozenset({"validate", "plan"})
"""Commands that only print: a closed stdout (`| head`) ends them quietly. Never the ones that talk to engines: with
SIGPIPE at its default action, a write to a socket an engine has just closed kills the process instead of raising
the BrokenPipeError the HTTP client resends on."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `megatron-rl` console command; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.command in ("convert", "check-parity"):
        _silence_library_warnings()
    on_pipe = signal.signal(signal.SIGPIPE, signal.SIG_DFL) if args.command in QUIET_ON_CLOSED_PIPE else None
    try:
        status: int = args.handler(args)
        return status
    except (
        ValueError,
        KeyError,
        FileNotFoundError,
        FileExistsError,
        RankFailedError,
        PlacementError,
        NonFiniteTrainingError,
        RankCallError,
        EngineRestartLimitError,
        AsyncEngineCrashError,
        EngineError,
    ) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        if on_pipe is not None:
            signal.signal(signal.SIGPIPE, on_pipe)  # a caller in-process (tests, notebooks) keeps its own


if __name__ == "__main__":
    sys.exit(main())
