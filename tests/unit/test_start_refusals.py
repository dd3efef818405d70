"""One source of truth for refusals: whatever the trainer, models, engines, weight sync or driver
refuse at start because of the recipe, `validate` refuses first, naming the field.

Every ``raise`` in those packages is listed here (found with ``ast``, so a new one fails
:func:`test_every_raise_is_classified` until it is added): either as a start-time refusal
caused by the recipe, with overrides that make the runtime raise it and the field `validate`
names, or as not caused by the recipe (a runtime state, an internal contract, the machine),
with the reason.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_rl.config import RecipeError, load_recipe
from megatron_rl.config.loading import read_recipe_tree
from tests.hf_configs import QWEN3_30B_A3B_CONFIG_FILE

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rl"
RECIPES = PACKAGE.parent / "recipes"
SCANNED = ("actor", "models", "engines", "rollout", "wire", "weight_sync", "orchestration", "parallel", "tools")
TINY = "tiny_moe_cpu_dapo.yaml"
QWEN_30B = "qwen3_30b_a3b_dapo.yaml"
DENSE = "model.random_init.architectures=[Qwen3ForCausalLM]"


@dataclass(frozen=True)
class Refusal:
    """A raise the recipe can cause at start; ``overrides`` cause it, ``field`` is what validate names."""

    path: str
    fragment: str
    overrides: tuple[str, ...]
    field: str
    recipe: str = TINY


START_REFUSALS = (
    Refusal(
        "actor/precision.py",
        "needs compute capability >= 10.0",
        ("train.precision=fp8", "train.fp8_recipe=mxfp8"),
        "train.fp8_recipe",
        QWEN_30B,
    ),
    Refusal(
        "actor/policy_actor.py",
        "temperature must be a finite number",
        ("rollout.temperature=0.0",),
        "rollout.temperature",
    ),
    Refusal("actor/precision.py", "needs train.fp8_recipe", ("train.precision=fp8",), "train.fp8_recipe", QWEN_30B),
    Refusal(
        "actor/precision.py",
        "needs Transformer Engine",
        ("train.precision=fp8", "train.fp8_recipe=delayed"),
        "train.precision",
    ),
    Refusal(
        "actor/precision.py",
        "routing_replay needs a MoE model",
        (DENSE, "parallel.ep=1", "algorithm.routing_replay=true"),
        "algorithm.routing_replay",
    ),
    Refusal(
        "models/megatron_config.py",
        "must divide num_attention_heads",
        ("parallel.tp=4", "parallel.sequence_parallel=true", "parallel.ep=1", "cluster.cpu_trainer_ranks=4"),
        "parallel.tp",
    ),
    Refusal(
        "models/megatron_config.py",
        "must divide intermediate_size",
        (
            "model.random_init.intermediate_size=129",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
            "parallel.ep=1",
        ),
        "parallel.tp",
    ),
    Refusal(
        "models/megatron_config.py",
        "ValueError(problem)",
        ("model.random_init.num_hidden_layers=3", "parallel.pp=2", "parallel.ep=1"),
        "parallel.pp",
    ),
    Refusal(
        "models/megatron_config.py",
        "must divide num_experts",
        ("parallel.ep=3", "cluster.cpu_trainer_ranks=3"),
        "parallel.ep",
    ),
    Refusal(
        "models/megatron_config.py",
        "must divide moe_intermediate_size",
        ("model.random_init.moe_intermediate_size=63", "parallel.etp=2", "parallel.ep=1"),
        "parallel.etp",
    ),
    Refusal("models/megatron_config.py", "needs a MoE model", (DENSE,), "parallel.ep"),
    Refusal(
        "models/safetensors_reader.py",
        "has neither",
        ("model.random_init=null", "model.path={config_only}"),
        "model.path",
    ),
    Refusal("parallel/distributed.py", "must be >= 1", ("parallel.tp=0",), "parallel.tp"),
    Refusal("parallel/distributed.py", "needs pp >= 2", ("parallel.vpp=2",), "parallel.vpp"),
    Refusal(
        "parallel/distributed.py",
        "not divisible by tp*pp*cp",
        ("parallel.ep=1", "parallel.pp=2", "cluster.cpu_trainer_ranks=3"),
        "parallel",
    ),
    Refusal("parallel/distributed.py", "not divisible by etp*ep*pp", ("cluster.cpu_trainer_ranks=3",), "parallel.ep"),
    Refusal("rollout/engine_pool.py", "needs at least one engine", ("cluster.cpu_engines=0",), "cluster.cpu_engines"),
    Refusal(
        "weight_sync/engine_feeds.py",
        "needs a trainer rank of its own",
        ("cluster.cpu_engines=3", "weight_sync.transport=tensor"),
        "cluster.cpu_engines",
    ),
    Refusal(
        "weight_sync/engine_feeds.py",
        "experts: EP must divide",
        ("model.random_init.num_experts=6", "rollout.tp=4", "rollout.ep=4"),
        "rollout.ep",
    ),
    Refusal(
        "engines/reference/server.py", "no config.json", ("model.random_init=null", "model.path={empty}"), "model.path"
    ),
    Refusal("engines/reference/backend.py", "TP rank(s); got", ("rollout.tp=2",), "rollout.tp"),
    Refusal(
        "engines/reference/backend.py",
        "longer than the model's context length",
        ("rollout.max_prompt_length=64",),
        "rollout.max_response_length",
    ),
    Refusal(
        "engines/reference/backend.py",
        "exceeds the model's maximum context length",
        ("rollout.max_response_length=60",),
        "rollout.max_response_length",
    ),
    Refusal(
        "rollout/scoring.py", "num_workers must be >= 1", ("data.reward_num_workers=0",), "data.reward_num_workers"
    ),
    Refusal("engines/sglang_engine.py", "an engine spanning nodes", ("rollout.tp=12",), "rollout.tp", QWEN_30B),
    Refusal(
        "weight_sync/lora_sync.py",
        "LORA_NOT_BY_BROADCAST",
        ("lora.rank=4", "weight_sync.transport=distributed"),
        "weight_sync.transport",
    ),
    Refusal(
        "engines/sglang_engine.py",
        "needs rollout.max_total_tokens",
        ("rollout.engine=sglang",),
        "rollout.max_total_tokens",
    ),
    Refusal(
        "orchestration/placement_group.py",
        "on each of",
        ("rollout.tp=2", "rollout.dp=3"),
        "rollout.tp",
        QWEN_30B,
    ),
    Refusal(
        "orchestration/network.py",
        "required on",
        ("cluster.nodes=2",),
        "cluster.network_interface",
    ),
    Refusal(
        "orchestration/network.py",
        "has no interface",
        ("cluster.nodes=2", "cluster.network_interface=nosuchif0"),
        "cluster.network_interface",
    ),
    Refusal(
        "weight_sync/buckets.py",
        "bucket_bytes must be >= 1",
        ("weight_sync.bucket_size_mb=0",),
        "weight_sync.bucket_size_mb",
    ),
    Refusal(
        "actor/step_data.py",
        "equal mini-batches",
        ("train.mini_batches_per_step=3",),
        "train.mini_batches_per_step",
    ),
)

# (path, fragment of the raise; "" for every raise of the file) -> why the recipe does not cause it.
NOT_FROM_THE_RECIPE: dict[tuple[str, str], str] = {
    ("rollout/sandbox_server.py", ""): "a request to `megatron-rl sandbox-server` or its command line, not a recipe",
    ("tools/sandbox_service.py", ""): "the sandbox service's answer at run time (rollout.tool_sandbox.url reached)",
    ("actor/batch.py", ""): "tensor shape contract of ActorBatch between driver and actor",
    ("actor/loss.py", ""): "the driver always sets old/reference log-probs and advantages before training",
    ("actor/packing.py", "row lengths"): "internal contract of the packer",
    ("actor/packing.py", "cannot pack"): "internal contract of the packer",
    ("actor/policy_actor.py", "initialize_parallel"): "call order inside the trainer worker",
    ("actor/policy_actor.py", "keeps no reference weights"): "the actor keeps them whenever use_kl_loss asks",
    ("actor/policy_actor.py", "has no LoRA adapter"): "internal: only an actor built with the recipe's lora "
    "section is asked for its adapter",
    ("actor/routing_replay.py", ""): "the actor sets moe_enable_routing_replay and the engines return routed experts "
    "whenever algorithm.routing_replay is on",
    ("models/forward.py", "same [batch, sequence] shape"): "internal contract of the schedule",
    ("models/hf_files.py", ""): "`convert --out` argument, not a recipe field",
    ("models/mcore_checkpoint.py", ""): "checkpoint contents",
    ("models/safetensors_reader.py", "CheckpointTensorError"): "checkpoint contents",
    (
        "models/lora.py",
        "",
    ): "not built yet (experts_shared_outer, dropout, TE grouped experts); `train` refuses `lora:` "
    "until LoRA training is wired (orchestration/driver.refuse_unbuilt)",
    ("models/lora_peft.py", ""): "adapter file contents",
    ("models/lora_merge.py", ""): "adapter contents (a run checkpoint's or a PEFT file's), not the recipe",
    ("models/weight_map.py", ""): "internal: every parameter the builder makes is mapped",
    ("rollout/manager.py", "generation batch"): "the driver sizes the sampler from train.prompts_per_step",
    ("rollout/engine_pool.py", "failures[0][1]"): "an engine crash at run time, re-raised by a pool without recovery",
    ("rollout/manager.py", "RolloutExhaustedError"): "runtime outcome of dynamic sampling (algorithm.dynamic_sampling)",
    ("engines/reference/backend.py", "EngineStateError"): "engine state at request time",
    ("engines/reference/backend.py", "state.error"): "a decode step that failed at run time, re-raised to its request",
    ("engines/reference/generator.py", "INVALID_PROBABILITIES"): "non-finite logits of a decode step at run "
    "time, refused as torch.multinomial refuses them (the step's requests fail)",
    ("engines/reference/slot_model.py", ""): "the model's config.json, which config/hf_config.py refuses first "
    "(RoPE scaling, sliding windows, activations other than SiLU)",
    ("engines/reference/backend.py", "names, dtypes and shapes"): "wire-format contract of a weight update",
    ("engines/reference/backend.py", "seeds a request, not each sample"): "request contract: the rollout manager "
    "sends per-sample seeds to SGLang engines only",
    ("engines/reference/backend.py", "Unknown load_format"): "wire-format contract of a weight update (our "
    "transports send None or flattened_bucket)",
    ("engines/reference/backend.py", "no *.safetensors"): "disk weight update contents, written by the trainer",
    ("engines/reference/backend.py", "weight elements"): "disk weight update contents, written by the trainer",
    ("engines/reference/backend.py", "WeightUpdateRefused"): "the weight-update protocol's state at request time "
    "(session, groups, flush), as SGLang refuses it",
    ("engines/reference/lora_adapters.py", ""): "a LoRA request's answer at request time (SGLang's refusals of its "
    "adapter, name or the engine's --enable-lora limits), not the recipe",
    ("engines/reference/backend.py", "self.lora.refusal"): "a LoRA load request's answer at request time (SGLang's)",
    ("engines/reference/backend.py", "expected_checksums"): "wire-format contract of a LoRA load (our client sends "
    "no checksums)",
    ("engines/reference/backend.py", "got {len(request.serialized_named_tensors)}"): "wire-format contract of a "
    "LoRA load: one payload per engine TP rank",
    ("engines/reference/server.py", "timeout must be >= 0"): "a request argument of /flush_cache",
    ("weight_sync/lora_sync.py", "failed on trainer rank"): "an engine's answer to an adapter load at sync time, "
    "raised on every trainer rank",
    ("weight_sync/lora_sync.py", "needs disk_dir"): "internal contract: the trainer worker passes the run's "
    "weight_sync directory",
    ("engines/reference/backend.py", "tp_rank"): "node rank and count of an engine spanning nodes, set by its host "
    "from the placement (engine_node_slots), not the recipe",
    ("engines/reference/engine.py", "node_rank"): "node rank and count of an engine spanning nodes, set by its host "
    "from the placement, not the recipe",
    ("engines/reference/engine.py", "needs dist_init_addr"): "the meeting address node 0's host picks at each start",
    ("engines/reference/node_group.py", ""): "the launch contract of an engine spanning nodes (node rank, "
    "dist_init_addr), filled in by its hosts from the placement",
    ("actor/step_data.py", "mini_batch_sizes"): "internal contract of StepData",
    ("actor/step_data.py", "must have shape"): "internal contract of StepData",
    ("actor/step_data.py", "does not split over"): "validate's batch divisibility check makes every full step "
    "split; the driver trims a partial one first",
    ("orchestration/engine_recovery.py", "EngineRestartLimitError"): "engine crashes at run time, past "
    "rollout.max_engine_restarts",
    ("orchestration/rollout_pipeline.py", "is due"): "internal: the driver takes steps in order",
    ("orchestration/engine_recovery.py", "AsyncEngineCrashError"): "engine crashes at run time, beside "
    "training with no other engine running",
    ("orchestration/driver.py", "weight versions old"): "internal: the pipeline's schedule and the rollout "
    "manager's stale-group rule never make such a token",
    ("orchestration/driver.py", "NonFiniteTrainingError"): "a run-time outcome of training "
    "(train.max_consecutive_bad_steps steps in a row with NaN/Inf gradients)",
    ("orchestration/driver.py", "LoRA training on GPUs is not built yet"): "a feature not built yet (issue 40), "
    "refused by design only at train start so that validate and plan accept and plan the lora section "
    "(test_lora_config.py::test_train_refuses_what_lora_does_not_build_yet_before_anything_starts)",
    ("orchestration/driver.py", "experts_shared_outer: true is not built yet"): "a feature not built yet (issue "
    "40), refused at train start as the GPU case",
    ("weight_sync/send_lock.py", "TimeoutError"): "a rank stuck in a weight update at run time",
    ("weight_sync/transports.py", "before begin()"): "call order inside the syncer",
    ("orchestration/resources.py", "that feed them their"): "where Ray put the bundles at run time (the plan "
    "puts each engine beside its feeders)",
    ("weight_sync/transports.py", "feeds no engine"): "call order inside the syncer (it sends no rank that feeds none)",
    ("weight_sync/transports.py", "in formats"): "internal: an engine's feeders export the same buckets",
    ("weight_sync/transports.py", "failed to load"): "an engine failing a weight update at run time",
    ("wire/dense_buckets.py", ""): "wire-format contract of a flattened distributed update (the sender "
    "packs aligned runs of tensors it holds)",
    ("weight_sync/bucket_buffers.py", "not in the bucket being sent"): "internal: the exporter sends every "
    "tensor it allocated in its bucket",
    ("orchestration/trainer_group.py", "shards for"): "the driver shards by the group's own DP size",
    ("orchestration/trainer_group.py", "trained on other samples"): "a delivery check at run time",
    ("engines/reference/weight_checker.py", ""): "a /weights_checker request's answer (SGLang's check), at request "
    "time",
    ("engines/reference/weights.py", ""): "weight update contents, written by the trainer's exporter",
    ("engines/reference/fp8_weights.py", ""): "weight update contents: one recipe makes both the engines' FP8 "
    "checkpoint and the trainer's FP8 syncs (rollout.quantization, rollout.fp8_block_size)",
    ("wire/fp8_blocks.py", ""): "internal: only the 2-D projection weights are quantised",
    ("engines/protocol.py", ""): "wire-format checks of engine requests and responses",
    ("rollout/judge_reward.py", "JudgeRewardError"): "the judge's answer at run time, caught: the response scores "
    "as failed",
    ("rollout/judge_reward.py", "at least one judge engine"): "internal: the run starts judge.num_engines >= 1 "
    "engines (PositiveInt) before it makes the judge's reward",
    ("rollout/scoring.py", "did not start within"): "the machine: a reward worker process that cannot start",
    ("rollout/scoring.py", "on the empty response"): "the reward's behaviour at run time; `validate` and "
    "prepare_data's contract check (data.reward) run the same probe first",
    (
        "rollout/scoring.py",
        "not a RewardOutput",
    ): "a reward's answer at run time, caught: the response scores as failed",
    ("rollout/tool_pool.py", "num_workers must be >= 1"): "the schema refuses rollout.tool_num_workers < 1 "
    "and rollout.tool_timeout_s <= 0 first (PositiveInt, PositiveFloat)",
    ("rollout/tool_pool.py", "rollout.tools: "): "the tool pool's start-up check of rollout.tools (each tool "
    "imports and can run on this machine), where the tools run; `validate` makes the same check first "
    "(episodes.check_episode)",
    ("rollout/episodes.py", "rollout.episode: "): "rollout.episode resolved by name or import path; `validate` "
    "resolves it first (episodes.check_episode), as it resolves data.reward",
    ("rollout/episodes.py", "rollout.tools: "): "`validate`'s own check of rollout.tools (episodes.check_episode): "
    "each tool imports and can run on this machine",
    ("rollout/tool_episode.py", "rollout.tools: "): "config/checks.py refuses tool episodes without tools first "
    "(rollout.tools); the one-tool rule of the synthetic format is the episode's own",
    ("rollout/tool_episode.py", "which the tokenizer does not"): "the tokenizer's chat format (the model's files), "
    "checked when the run builds its episode, before Ray starts",
    ("rollout/tool_pool.py", "cannot run on this machine"): "the machine: a tool's requirement (the python tool's "
    "sandbox), re-raised by the pool naming rollout.tools",
    ("rollout/tool_pool.py", "not str"): "a tool's answer at run time, caught: the call fails with an error "
    "the model reads",
    ("tools/calculator.py", ""): "the calculator refusing a model's expression at run time: the model reads the error",
    ("tools/python_tool.py", ""): "the python tool refusing a model's arguments at run time: the model reads the error",
    ("tools/calls.py", ""): "a malformed tool call in a model's turn at run time: the model reads the error",
    ("tools/sandbox.py", ""): "the machine (Linux, user namespaces, mounts) where code is sandboxed, and the python "
    "tool's fixed limits",
    ("tools/sandbox_init.py", ""): "a libc call of the sandbox's set-up, reported as SandboxUnavailableError "
    "naming the step",
    ("engines/http_engine.py", ""): "engine failures and timeouts at run time",
    ("engines/server_process.py", ""): "platform (Linux) and process state",
    ("engines/sglang_engine.py", "must be"): "ports and GPU ids come from the placement, not the recipe",
    ("engines/sglang_engine.py", "no SGLang installation"): "the machine: where SGLang is installed (validate "
    "checks it too, naming rollout.engine)",
    ("engines/sglang_cpu.py", ""): "the machine: a C compiler for the driver stand-in, or a GPU where a CPU engine "
    "was asked for (the recipe's cluster.gpus_per_node decides)",
    ("engines/sglang_engine.py", "control character"): "the run's API key (drawn by the run, or "
    "MEGATRON_RL_ENGINE_API_KEY), not a recipe field",
    ("engines/access.py", "refusing to listen"): "engine addresses come from the run's network (127.0.0.1 or "
    "the address of cluster.network_interface), never a wildcard",
    ("orchestration/network.py", "no IPv4 address"): "the machine: how the node's interface is configured",
    ("weight_sync/syncer.py", ""): "the trainer worker always passes master_address, disk_dir and hf_config_dir",
    ("wire/weight_group.py", ""): "internal: rank and backend come from the transport",
    ("wire/tensor_serialization.py", ""): "payload contents at run time",
    ("orchestration/batch_assembly.py", ""): "internal contract between rollout manager and driver",
    ("orchestration/validation.py", ""): "checked first: eval's --sets against the recipe's sets (cli), and a set "
    "training runs without prompts by validate (validation.sets.<name>.files)",
    ("orchestration/memory_handover.py", ""): "call order of the colocated hand-over",
    ("orchestration/placement_group.py", "PlacementError"): "the Ray cluster's free resources, not the recipe",
    ("orchestration/worker_group.py", ""): "internal call contract",
    ("orchestration/engine_host.py", ""): "GPU visibility of the process and engine start-up failures",
    ("orchestration/trainer_worker.py", "connect_engines"): "start_run connects every rank before any weight sync",
    ("orchestration/trainer_worker.py", "RankPaths takes absolute paths"): "internal: start_trainers builds "
    "RankPaths.of, which resolves the run's folders against the driver's working directory",
    ("orchestration/engine_host.py", "EngineSpec takes absolute paths"): "internal: engine_specs resolves the "
    "model and log folders against the driver's working directory",
    ("parallel/device.py", ""): "process environment (LOCAL_RANK, CUDA_VISIBLE_DEVICES)",
    ("parallel/device.py", "ValueError(mismatch)"): "the machine: the GPU a trainer rank finds at start, compared "
    "with the recipe's cluster.gpu_arch (validate may run where there is none, e.g. a login node)",
    ("parallel/local_launch.py", ""): "re-raises a rank's failure",
    ("parallel/cpu_compat.py", ""): "internal to the CPU compatibility layer",
    ("actor/policy_actor.py", "the parallel state was initialised"): "internal: the trainer worker initialises the "
    "parallel state from the same recipe section",
    ("parallel/context_parallel.py", ""): "internal: padded_sequence_multiple makes every row a multiple of 2 * cp",
    ("models/context_parallel_attention.py", ""): "internal: the GPT model passes no mask and, unpacked, no THD "
    "parameters",
}


def _raises() -> list[tuple[str, str]]:
    """(path under megatron_rl/, source of the raise statement) of every raise with an exception."""
    found = []
    for package in SCANNED:
        for file in sorted((PACKAGE / package).rglob("*.py")):
            source = file.read_text()
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.Raise) and node.exc is not None and not isinstance(node.exc, ast.Name):
                    segment = ast.get_source_segment(source, node)
                    assert segment is not None, "a node ast.parse gave has its position"
                    found.append((str(file.relative_to(PACKAGE)), " ".join(segment.split())))
    return found


def _specific(path: str, statement: str) -> list[object]:
    refusals = [r for r in START_REFUSALS if r.path == path and r.fragment in statement]
    reasons = [key for key in NOT_FROM_THE_RECIPE if key[0] == path and key[1] and key[1] in statement]
    return [*refusals, *reasons]


def test_every_raise_is_classified() -> None:
    unclassified = []
    for path, statement in _raises():
        if not _specific(path, statement) and (path, "") not in NOT_FROM_THE_RECIPE:
            unclassified.append(f"{path}: {statement}")
    assert unclassified == [], "classify each new raise in START_REFUSALS or NOT_FROM_THE_RECIPE"


def test_no_classification_is_stale() -> None:
    raises = _raises()
    for refusal in START_REFUSALS:
        assert any(p == refusal.path and refusal.fragment in s for p, s in raises), refusal
    for path, fragment in NOT_FROM_THE_RECIPE:
        assert any(p == path and fragment in s for p, s in raises), (path, fragment)


@pytest.fixture
def model_dirs(tmp_path: Path) -> dict[str, str]:
    """An empty directory, and one holding only a config.json (no weights)."""
    empty, config_only = tmp_path / "empty", tmp_path / "config_only"
    empty.mkdir()
    config_only.mkdir()
    tiny_config = read_recipe_tree(RECIPES / TINY)["model"]["random_init"]
    (config_only / "config.json").write_text(json.dumps(tiny_config))
    return {"empty": str(empty), "config_only": str(config_only)}


def _recipe_overrides(recipe: str) -> list[str]:
    return [f"model.config_fallback={QWEN3_30B_A3B_CONFIG_FILE}"] if recipe == QWEN_30B else []


@pytest.mark.parametrize("recipe", [TINY, QWEN_30B])
def test_the_recipes_the_refusals_start_from_are_valid(recipe: str) -> None:
    load_recipe(RECIPES / recipe, _recipe_overrides(recipe), require_files=False)


@pytest.mark.parametrize("refusal", START_REFUSALS, ids=lambda r: f"{r.path}:{r.fragment}")
def test_validate_refuses_what_the_runtime_would(refusal: Refusal, model_dirs: dict[str, str]) -> None:
    overrides = [*_recipe_overrides(refusal.recipe), *(o.format(**model_dirs) for o in refusal.overrides)]
    with pytest.raises(RecipeError) as info:
        load_recipe(RECIPES / refusal.recipe, overrides, require_files=refusal.recipe == TINY)
    fields = [problem.split(":", 1)[0] for problem in info.value.problems]
    assert refusal.field in fields, info.value.problems
