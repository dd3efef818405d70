"""Shrink a recipe to a CPU smoke run of its own settings (`megatron-rl smoke`).

:func:`smoke_recipe` takes a validated recipe and returns the dotted overrides that make it
run on a 2-core CPU machine in seconds, each with the reason, while keeping what the recipe
is about: its algorithm (preset, loss mode, advantages, clipping, KL, dynamic sampling and
its metric, overlong shaping and filtering, TIS, routing replay), recompute, mini-batches and
PPO epochs, placement and weight-sync transport, and every kind of parallelism it uses:

- model: the same architecture at toy width (hidden 64, 4 heads over 2 KV heads, the same
  layer kinds: dense layers stay dense, MoE layers MoE), experts reduced to 4 (or 2 x ep),
  top-k kept where it fits (at most half the experts), enough layers for pp x vpp (an uneven
  pipeline stays uneven: its first stage holds half the layers of the other);
- layout: tp, pp, vpp, cp, ep, etp each kept at 2 when the recipe uses them (tp > 1 with
  sequence parallelism), data parallelism 2 when the recipe has it and the ranks stay <= 4;
- hardware: CPU ranks, one reference engine instead of SGLang, fp32 training instead of bf16 / fp8 (FP8
  rollouts stay, at a block the toy model's projections fill);
- data: for a recipe that reads data files (absent here, or present but tokenized for the real
  model), generated prompts in its data format:
  verl-layout parquet files with chat-message prompts (the synthetic successor task, written
  by the caller into :func:`generated_data_paths`), read through the recipe's own parquet
  path and chat-template setting, with the task's tokenizer and reward (the recipe's reward
  cannot score the toy task); 4 prompts a step, short prompts and responses; a multi-turn tool
  recipe gets the synthetic ``lookup`` task instead, its tool and the toy tokenizer's call format,
  so its episodes still call a tool between turns;
- run: 2 steps, a checkpoint after each (the smoke runs step 1, then resumes to step 2).

Imports neither torch nor Ray: the overrides are checked by ``validate`` like any others.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from megatron_rl.config.hf_config import QwenArchitecture
from megatron_rl.config.layout import trainer_layout
from megatron_rl.config.schema import RunConfig

MAX_CPU_RANKS = 4
SMOKE_STEPS = 2
SMOKE_TASK = "successor"
"""The synthetic task whose prompts stand in for absent data (its files: ``<task>_train|val.parquet``)."""
SMOKE_TOOL_TASK = "lookup"
"""The stand-in task of a multi-turn tool recipe: one answered by a tool call in the toy tokenizer's format."""


def smoke_task(cfg: RunConfig) -> str:
    """The synthetic task standing in for ``cfg``'s data: a tool task when its episode calls tools."""
    return SMOKE_TASK if cfg.rollout.episode == "single_turn" else SMOKE_TOOL_TASK


@dataclass(frozen=True)
class Change:
    """One override of the smoke run: ``field=value``, and why."""

    field: str
    value: Any
    reason: str

    @property
    def override(self) -> str:
        """The dotted override, YAML-parsable (lists and mappings in flow style)."""
        return f"{self.field}={_yaml_scalar(self.value)}"

    def __str__(self) -> str:
        return f"{self.override}  # {self.reason}"


def _yaml_scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(_yaml_scalar(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml_scalar(v)}" for k, v in value.items()) + "}"
    return str(value)


class _Layout(TypedDict):
    """The smoke run's parallel sizes and trainer ranks (vpp and etp None when the recipe leaves them unset)."""

    tp: int
    pp: int
    vpp: int | None
    cp: int
    ep: int
    etp: int | None
    uneven: bool
    world: int


def _shrunk_layout(cfg: RunConfig) -> _Layout:
    par = cfg.parallel
    tp = 2 if par.tp > 1 else 1
    pp = 2 if par.pp > 1 else 1
    vpp = 2 if par.vpp is not None else None
    cp = 2 if par.cp > 1 else 1
    ep = 2 if par.ep > 1 else 1
    etp = None if par.etp is None else (2 if par.etp > 1 else 1)
    model_parallel = tp * pp * cp
    expert_parallel = (tp if etp is None else etp) * ep * pp
    had_dp = trainer_layout(par, cfg.cluster, cfg.rollout).dp > 1
    world = model_parallel * (2 if had_dp and model_parallel * 2 <= MAX_CPU_RANKS else 1)
    while world % expert_parallel:
        world *= 2
    uneven = pp > 1 and (par.first_stage_layers is not None or par.last_stage_layers is not None)
    return {"tp": tp, "pp": pp, "vpp": vpp, "cp": cp, "ep": ep, "etp": etp, "uneven": uneven, "world": world}


TOY_FP8_BLOCK = (32, 32)
"""FP8 rollouts' block for the toy model: its K/V projections have 2 x 16 rows, the others more (SGLang needs each
merged projection's rows to be a multiple of the block's)."""


def _toy_model(arch: QwenArchitecture, layout: _Layout) -> dict[str, Any]:
    chunks = layout["vpp"] or 1
    has_dense = not all(arch.moe_layer_pattern)
    layers = 3 * chunks if layout["uneven"] else max(2, layout["pp"] * chunks)
    config: dict[str, Any] = {
        "architectures": [arch.architecture],
        "vocab_size": 32,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 64,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": 10000.0,
        "tie_word_embeddings": arch.tie_word_embeddings,
    }
    if arch.is_moe:
        experts = max(4, 2 * layout["ep"])
        config |= {
            "num_experts": experts,
            "num_experts_per_tok": min(arch.moe_router_topk, experts // 2),
            "moe_intermediate_size": 64,
            "norm_topk_prob": arch.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [0] if has_dense else [],
        }
    return config


def _data_absent(cfg: RunConfig) -> bool:
    return any(not Path(f).is_file() for f in [*cfg.data.train_files, *cfg.data.val_files])


@dataclass(frozen=True)
class GeneratedData:
    """Where the smoke run's generated prompts and their tokenizer go (the caller writes them)."""

    train_file: str
    val_file: str
    tokenizer_dir: str
    task: str


def generated_data_paths(cfg: RunConfig) -> GeneratedData | None:
    """Paths of the generated data for a recipe that reads files; None for a synthetic task.

    Files present here are replaced too: their tokenizer is the real model's, too large for the toy one.
    """
    if cfg.data.synthetic is not None:
        return None
    directory, task = f"runs/smoke-{cfg.name}/generated", smoke_task(cfg)
    return GeneratedData(
        f"{directory}/{task}_train.parquet", f"{directory}/{task}_val.parquet", f"{directory}/tokenizer", task
    )


def smoke_recipe(cfg: RunConfig, arch: QwenArchitecture) -> list[Change]:
    """The overrides turning ``cfg`` into its CPU smoke run (see the module docstring), in a fixed order.

    ``arch``: the recipe's architecture (from its config.json or ``model.config_fallback``). The
    run writes under ``runs/smoke-<name>``.
    """
    run_dir = f"runs/smoke-{cfg.name}"
    layout = _shrunk_layout(cfg)
    changes = [
        Change("name", f"smoke-{cfg.name}", "own run directory"),
        Change("model.path", None, "toy model at random init"),
        Change("model.config_fallback", None, "toy model at random init"),
        Change("model.random_init", _toy_model(arch, layout), f"{arch.architecture} at toy width"),
        Change("cluster.nodes", 1, "one CPU machine"),
        Change("cluster.gpus_per_node", 0, "CPU ranks"),
        Change("cluster.cpu_trainer_ranks", layout["world"], "every kind of parallelism kept, at most 4 ranks"),
        Change("cluster.cpu_engines", 1, "one engine"),
        Change("parallel.tp", layout["tp"], "kept if used"),
        Change("parallel.sequence_parallel", layout["tp"] > 1, "with tp > 1"),
        Change("parallel.pp", layout["pp"], "kept if used"),
        Change("parallel.vpp", layout["vpp"], "kept if used"),
        Change("parallel.cp", layout["cp"], "kept if used"),
        Change(
            "parallel.first_stage_layers",
            (layout["vpp"] or 1) if layout["uneven"] else None,
            "an uneven pipeline kept: 1 layer per chunk on the first stage, 2 on the second",
        ),
        Change("parallel.last_stage_layers", None, "the toy pipeline's second stage takes what the first leaves"),
        Change("parallel.ep", layout["ep"], "kept if used"),
        Change("parallel.etp", layout["etp"], "kept if used"),
        Change("rollout.engine", "reference", "the fast CPU engine (SGLang on CPU is slower; see tests/sglang)"),
        Change("rollout.tp", 1, "the reference engine is one process"),
        Change("rollout.ep", 1, "the reference engine is one process"),
        Change("rollout.dp", 1, "the reference engine is one process"),
        Change("rollout.num_gpus", None, "no GPUs"),
        Change("rollout.n_samples_per_prompt", 8, "small groups"),
        Change("rollout.max_prompt_length", 24, "toy lengths (chat-template prompts included)"),
        Change("rollout.max_response_length", 12, "toy lengths"),
        Change("rollout.max_concurrent_requests", 16, "toy batch"),
        Change("rollout.startup_timeout_s", 120.0, "CPU engine"),
        Change("train.precision", "fp32", "CPU"),
        Change("train.fp8_recipe", None, "CPU"),
        Change("train.steps", SMOKE_STEPS, "smoke"),
        Change("train.prompts_per_step", 4, "toy batch"),
        Change("train.mini_batches_per_step", min(cfg.train.mini_batches_per_step, 2), "kept if > 1, at most 2"),
        Change("train.max_tokens_per_micro_batch", 64, "several micro-batches"),
        Change("train.warmup_steps", min(cfg.train.warmup_steps, 1), "within 2 steps"),
        Change("train.lr", 1.0e-3, "toy model"),
        Change("validation.interval", SMOKE_STEPS, "validate before and after"),
        Change("checkpoint.dir", None, f"under {run_dir}"),
        Change("checkpoint.interval", 1, "checkpoint every step; the second step resumes from the first"),
        Change("checkpoint.resume", "auto", "resume from the first step"),
        Change("logging.dir", None, f"under {run_dir}"),
        Change("logging.sinks", ["console", "jsonl"], "no external services"),
        Change("data.reward_num_workers", 1, "2 cores"),
    ]
    algo = cfg.algorithm
    if algo.overlong.enable or algo.overlong.filter_truncated:
        changes.append(Change("algorithm.overlong.buffer_length", 4, "within the toy response length"))
    if cfg.rollout.quantization == "fp8":
        changes += [
            Change("rollout.fp8_block_size", list(TOY_FP8_BLOCK), "FP8 rollouts kept: blocks the toy projections fill"),
            Change("rollout.fp8_checkpoint", None, "FP8 rollouts kept: converted from the toy model at start"),
        ]
    if cfg.rollout.partial_rollout_tokens is not None:
        changes.append(Change("rollout.partial_rollout_tokens", 4, "windows within the toy response length"))
    if algo.loss_norm_constant is not None:
        changes.append(Change("algorithm.loss_norm_constant", None, "defaults to the toy response length"))
    if algo.dynamic_sampling.enable:
        changes += [
            Change(
                "algorithm.dynamic_sampling.gen_batch_prompts", 16, "over-sample: a random-init model rarely has signal"
            ),
            Change("algorithm.dynamic_sampling.on_exhausted", "train_partial", "a random-init model"),
        ]
    generated = generated_data_paths(cfg)
    for name, validation_set in cfg.validation.sets.items():
        n = min(validation_set.n, 2)
        changes += [
            Change(f"validation.sets.{name}.n", n, "toy validation"),
            Change(
                f"validation.sets.{name}.ks",
                sorted({1, n}) if validation_set.ks else [],
                "pass@k and maj@k kept at toy n",
            ),
            Change(f"validation.sets.{name}.max_response_length", None, "toy lengths"),
        ]
        if validation_set.files:
            files = [generated.val_file] if generated is not None else []
            changes.append(Change(f"validation.sets.{name}.files", files, "the generated validation prompts"))
    if generated is None:
        changes.append(Change("model.tokenizer", None, "the recipe's own data brings its tokenizer"))
    else:
        why = (
            "the recipe's data files are not here"
            if _data_absent(cfg)
            else "the recipe's data needs its model's tokenizer"
        ) + ": generated prompts in its format (verl parquet, chat messages)"
        changes += [
            Change("data.train_files", [generated.train_file], why),
            Change("data.val_files", [generated.val_file], why),
            Change("data.prompt_key", "prompt", "the generated files' column"),
            Change("data.answer_key", "reward_model.ground_truth", "the generated files' column"),
            Change("model.tokenizer", generated.tokenizer_dir, "the generated task's tokenizer"),
            Change("data.reward", f"synthetic_{generated.task}", "the generated task's reward"),
        ]
        if cfg.data.remote_reward is not None:
            changes.append(Change("data.remote_reward", None, "the generated task's reward is local"))
        if cfg.judge is not None:
            changes.append(Change("judge", None, "the generated task's reward is local: no judge model on a smoke run"))
        if generated.task == SMOKE_TOOL_TASK:
            changes += [
                Change(
                    "rollout.episode",
                    "synthetic_tool_calls",
                    f"multi-turn kept: the toy tokenizer's call format ({cfg.rollout.episode} needs the model's)",
                ),
                Change("rollout.tools", ["synthetic_lookup"], "the generated task's tool"),
                Change("rollout.tool_num_workers", 1, "2 cores"),
            ]
    return changes
