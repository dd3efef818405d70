"""The recipe schema: one pydantic model per section, every field documented.

A recipe is a YAML file (see ``recipes/``) validated into :class:`RunConfig`.
Section models check what can be checked from the section alone (types, ranges,
unknown keys); checks that relate several sections or the model's Hugging Face
config live in :mod:`megatron_rl.config.checks`.

Components receive their own section (``cfg.rollout``, ``cfg.train``), never the
whole recipe.
"""

from __future__ import annotations

import ipaddress
import re
import string
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KLKind = Literal["k1", "k2", "k3", "low_var_kl"]


def _top_k_not_zero(value: int) -> int:
    if value == 0:
        raise ValueError("top_k 0 would sample nothing; use -1 to disable top-k or a positive k")
    return value


TopK = Annotated[int, AfterValidator(_top_k_not_zero)]
"""Top-k sampling: -1 disables it, 0 is refused (it would sample nothing)."""


class Section(BaseModel):
    """Base of every section: unknown keys are errors, types are not coerced from strings."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True, frozen=True)


class ModelConfig(Section):
    """The policy model: a Hugging Face checkpoint, or a random initialisation from an inline config."""

    path: str | None = Field(None, description="Hugging Face checkpoint directory (config.json + safetensors).")
    random_init: dict[str, Any] | None = Field(
        None,
        description="Hugging Face config fields (with 'architectures') of a model to initialise at random "
        "instead of loading `path`; used by the tiny CPU recipes.",
    )
    tokenizer: str | None = Field(
        None, description="Tokenizer directory; defaults to `path`. Not needed with a synthetic data task."
    )
    config_fallback: str | None = Field(
        None,
        description="A config.json file that `validate` and `plan` read while `path` has none yet (before the "
        "weights are downloaded), e.g. recipes/models/qwen3_30b_a3b/config.json; relative to the working "
        "directory. Training always reads `path`.",
    )

    @model_validator(mode="after")
    def _exactly_one_source(self) -> ModelConfig:
        if (self.path is None) == (self.random_init is None):
            raise ValueError("set exactly one of model.path (a Hugging Face checkpoint) or model.random_init")
        if self.config_fallback is not None and self.path is None:
            raise ValueError("model.config_fallback stands in for model.path's config.json: set model.path")
        return self


class ParallelConfig(Section):
    """Megatron-core parallel sizes of the trainer."""

    tp: PositiveInt = Field(1, description="Tensor-parallel size.")
    pp: PositiveInt = Field(1, description="Pipeline-parallel size.")
    vpp: PositiveInt | None = Field(None, description="Virtual pipeline stages per PP rank (interleaved schedule).")
    first_stage_layers: PositiveInt | None = Field(
        None,
        description="Decoder layers of the first pipeline stage for an uneven split (Megatron's "
        "num_layers_in_first_pipeline_stage); the middle stages share what first and last leave evenly.",
    )
    last_stage_layers: PositiveInt | None = Field(
        None, description="Decoder layers of the last pipeline stage for an uneven split (see first_stage_layers)."
    )
    cp: PositiveInt = Field(1, description="Context-parallel size.")
    ep: PositiveInt = Field(1, description="Expert-parallel size.")
    etp: PositiveInt | None = Field(None, description="Expert tensor-parallel size; defaults to `tp`.")
    sequence_parallel: bool = Field(
        False,
        description="Megatron sequence parallelism: the trainer runs it exactly when tp > 1, so set it to tp > 1.",
    )

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size after defaulting to ``tp``."""
        return self.tp if self.etp is None else self.etp


class OverlongConfig(Section):
    """DAPO overlong handling: soft punishment and/or filtering of truncated responses."""

    enable: bool = Field(False, description="Add DAPO's soft overlong punishment to the score.")
    buffer_length: PositiveInt = Field(
        4096, description="L_cache: the penalty ramps over this many tokens before the maximum."
    )
    penalty_factor: PositiveFloat = Field(1.0, description="Penalty at and beyond the maximum response length.")
    filter_truncated: bool = Field(False, description="Mask truncated responses out of the loss (overlong filtering).")


class DynamicSamplingConfig(Section):
    """DAPO dynamic sampling: drop zero-variance groups and over-sample until the step is full."""

    enable: bool = Field(
        False, description="Drop groups without a learning signal (see `metric`) and generate more batches."
    )
    metric: Literal["acc", "score"] = Field(
        "acc",
        description="What must vary inside a group for it to be kept: `acc` (the DAPO paper: 0 < #correct < G; "
        "shaped scores such as the overlong penalty do not count) or `score` (the shaped scores, verl's "
        "metric=score).",
    )
    max_gen_batches: PositiveInt = Field(10, description="Generation batches per step before giving up.")
    gen_batch_prompts: PositiveInt | None = Field(
        None,
        description="Prompts per generation batch; more than train.prompts_per_step over-samples (the surplus "
        "is aborted once the step is full). Defaults to train.prompts_per_step.",
    )
    on_exhausted: Literal["error", "train_partial"] = Field(
        "error",
        description="When max_gen_batches is hit short of a full step: stop with an error, or train on the groups "
        "kept so far (logged).",
    )


class AlgorithmConfig(Section):
    """Advantage, loss and regularisation settings (DESIGN.md section 3)."""

    preset: Literal["dapo", "drgrpo", "grpo", "custom"] = Field(
        "custom",
        description="The algorithm this recipe claims to be; settings that contradict it are errors. "
        "Use `custom` for ablations.",
    )
    advantage_estimator: Literal["grpo"] = Field(
        "grpo", description="Group-relative advantage estimator (the driver takes it from the algorithms' registry)."
    )
    norm_adv_by_std: bool = Field(True, description="Divide advantages by the group std (off for Dr.GRPO).")
    loss_agg_mode: LossAggMode = Field("token-mean", description="How per-token losses become the step loss.")
    loss_norm_constant: PositiveInt | None = Field(
        None,
        description="Divisor of seq-mean-token-sum-norm (set only with that mode); defaults to "
        "rollout.max_response_length.",
    )
    policy_loss: Literal["ppo_clip", "gspo"] = Field("ppo_clip", description="Policy-gradient loss.")
    clip_low: PositiveFloat = Field(0.2, le=1.0, description="Lower PPO clip: ratio >= 1 - clip_low (at most 1).")
    clip_high: PositiveFloat = Field(0.2, description="Upper PPO clip: ratio <= 1 + clip_high (DAPO: 0.28).")
    clip_c: float | None = Field(None, gt=1.0, description="Dual-clip bound for negative advantages (> 1), or off.")
    use_kl_loss: bool = Field(False, description="Add a KL(policy || reference) loss term.")
    reference_placement: Literal["host", "device"] = Field(
        "host",
        description="Where the reference weights of the KL loss live between uses: pinned host memory (no GPU "
        "bytes; two host<->device copies per reference pass) or the GPU (one more copy of the parameters; "
        "device copies only). `megatron-rl plan` counts them where they live.",
    )
    kl_type: KLKind = Field("low_var_kl", description="KL estimator of the loss term.")
    kl_coef: float = Field(0.0, ge=0.0, description="Coefficient of the KL loss term.")
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus coefficient.")
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    tis_cap: PositiveFloat | None = Field(
        None, description="Truncated importance sampling cap on exp(logp_old_trainer - logp_rollout), or off."
    )
    routing_replay: bool = Field(False, description="Replay the experts the rollout engine routed to (R3, MoE only).")


class ToolSandboxConfig(Section):
    """A sandbox service the python tool sends its code to (``megatron-rl sandbox-server`` or SandboxFusion)."""

    url: str = Field(
        description="Base URL of the service, e.g. http://10.0.0.5:8080 (POST /run_code is appended); the run's "
        "API key ($MEGATRON_RL_ENGINE_API_KEY) is sent as 'Authorization: Bearer' when set."
    )
    timeout_s: PositiveFloat = Field(
        60.0, description="Seconds one request may take (the sandbox's 20 s wall limit and a queue at the service)."
    )
    retries: NonNegativeInt = Field(
        3, description="Retries of a request after a connection error or a 5xx answer, with doubling backoff."
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")) or len(url.rstrip("/")) <= len("https://"):
            raise ValueError(f"{url!r} is not an http:// or https:// URL")
        return url


class RolloutConfig(Section):
    """Generation engines and sampling."""

    engine: Literal["sglang", "reference"] = Field("sglang", description="Rollout engine implementation.")
    tp: PositiveInt = Field(1, description="Tensor-parallel size of each engine.")
    ep: PositiveInt = Field(1, description="Expert-parallel size of each engine.")
    dp: PositiveInt = Field(1, description="Data-parallel replicas inside each engine.")
    placement: Literal["colocated", "disaggregated"] = Field(
        "colocated", description="Engines share the trainer's GPUs (colocated) or have their own (disaggregated)."
    )
    num_gpus: PositiveInt | None = Field(None, description="GPUs reserved for engines when disaggregated.")
    n_samples_per_prompt: PositiveInt = Field(8, description="Responses per prompt (the group size).")
    temperature: float = Field(
        1.0,
        description="Sampling temperature of the training rollouts, finite and > 0 (a recipe check): the trainer's "
        "log-probs, entropy and KL are those of softmax(logits / temperature).",
    )
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Nucleus sampling mass. Training rollouts need 1.0 (a recipe check): the trainer's log-probs "
        "are of the untruncated softmax.",
    )
    top_k: TopK = Field(-1, ge=-1, description="Top-k sampling; -1 disables it (required for training rollouts).")

    max_prompt_length: PositiveInt = Field(1024, description="Longer prompts are filtered out of the dataset.")
    max_response_length: PositiveInt = Field(1024, description="Maximum new tokens per response.")
    partial_rollout_tokens: PositiveInt | None = Field(
        None,
        description="Partial rollouts: a training step's generation gives each response at most this many new "
        "tokens; a response cut there continues in the next step's generation under the newer weights (its "
        "tokens keep the version they were sampled under; needs algorithm.tis_cap). None: every response is "
        "generated whole in one step.",
    )
    partial_rollout_max_windows: PositiveInt = Field(
        4,
        description="Partial rollouts: the most steps' generations one response spans; its last window has no "
        "cap, so its oldest token is at most this minus 1 weight versions older than its newest.",
    )
    mem_fraction: float = Field(
        0.8, gt=0.0, lt=1.0, description="Engine GPU memory fraction (SGLang mem_fraction_static)."
    )
    quantization: Literal["fp8"] | None = Field(
        None,
        description="fp8: the engines serve blockwise FP8 weights (e4m3, one float32 scale per block), started from "
        "an FP8 checkpoint (rollout.fp8_checkpoint, else converted from the bf16 one at run start) and sent FP8 "
        "weights and scales at every sync; training stays in train.precision.",
    )
    fp8_block_size: list[PositiveInt] = Field(
        [128, 128],
        min_length=2,
        max_length=2,
        description="FP8 rollouts: the [output, input] block of each weight scale (Qwen's FP8 checkpoints: 128 x 128).",
    )
    fp8_checkpoint: str | None = Field(
        None,
        description="FP8 rollouts: an FP8 Hugging Face checkpoint of the model for the engines to start from (e.g. "
        "`megatron-rl convert hf-to-fp8` output); None: converted into <run_dir>/rollout_fp8 at run start.",
    )
    deterministic_inference: bool = Field(
        False,
        description="SGLang's --enable-deterministic-inference: batch-invariant kernels, so a sample's tokens depend "
        "on its seed and weights only (slower; the reference engine is always deterministic).",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="SGLang's --dtype of the engine's weights and activations (auto: the checkpoint's, but float32 "
        "checkpoints in float16); CPU recipes use float32 so the train/rollout gap measures the code.",
    )
    max_total_tokens: PositiveInt | None = Field(
        None,
        description="SGLang's KV cache size in tokens (--max-total-tokens); None: sized from mem_fraction. "
        "Required for SGLang on CPU, which would size its cache from the host's memory.",
    )
    max_concurrent_requests: PositiveInt = Field(256, description="Requests in flight per engine.")
    startup_timeout_s: PositiveFloat = Field(600.0, description="Seconds to wait for an engine to become healthy.")
    request_timeout_s: PositiveFloat = Field(3600.0, description="Seconds before a generate request is an error.")
    max_engine_restarts: NonNegativeInt = Field(
        3,
        description="Engine crashes survived in a run: each restarts the engine on its bundle, re-syncs the weights "
        "and resubmits its requests with their seeds; one more crash ends the run (0: the first does).",
    )

    episode: str = Field(
        "single_turn",
        description="How a response unfolds over turns: single_turn; tool_calls (multi-turn tool use in Qwen3's "
        "<tool_call> format); synthetic_tool_calls (the synthetic tokenizer's one-token call); or an import path "
        "'package.module:factory' (megatron_rl.rollout.episodes).",
    )
    max_turns: PositiveInt = Field(
        8, description="Multi-turn episodes: the most model turns in one response (its last turn's call is not run)."
    )
    tools: list[str] = Field(
        [],
        description="Multi-turn episodes: the tools the model may call, registered names (calculator, python) or "
        "import paths 'package.module:function' (megatron_rl.tools).",
    )
    tool_timeout_s: PositiveFloat = Field(
        30.0, description="Seconds a tool call may run; past it the call fails and the model reads an error."
    )
    tool_num_workers: PositiveInt = Field(4, description="Tool worker processes (calls run in parallel up to this).")
    tool_sandbox: ToolSandboxConfig | None = Field(
        None,
        description="Where the python tool runs its code: None, the local sandbox (docs/tools.md); or a sandbox "
        "service speaking SandboxFusion's run_code API, for nodes where the sandbox cannot run.",
    )
    max_tool_calls_per_turn: PositiveInt = Field(
        4,
        description="Multi-turn episodes: the most tool calls run from one model turn (Qwen3's format may hold "
        "several <tool_call> blocks; they run in parallel); each call beyond it gets an error reply, not run.",
    )

    @property
    def fp8_block(self) -> tuple[int, int]:
        """``fp8_block_size`` as (output rows, input columns) per scale."""
        return self.fp8_block_size[0], self.fp8_block_size[1]


class WeightSyncConfig(Section):
    """How trained weights reach the engines."""

    transport: Literal["auto", "tensor", "distributed", "disk"] = Field(
        "auto",
        description="auto: tensor when colocated, distributed when disaggregated; disk writes safetensors under "
        "runs/<name>/weight_sync (a filesystem every node shares) for /update_weights_from_disk.",
    )
    bucket_size_mb: PositiveInt = Field(512, description="Size of each transfer bucket in MiB.")

    def resolved(self, placement: str) -> Literal["tensor", "distributed", "disk"]:
        """The transport a sync uses at ``placement``: ``transport``, ``auto`` as tensor when colocated, distributed
        when disaggregated (the one place this rule lives)."""
        if self.transport == "auto":
            return "tensor" if placement == "colocated" else "distributed"
        return self.transport


class SyntheticDataConfig(Section):
    """A generated task instead of parquet files (tiny CPU recipes)."""

    task: Literal["successor", "max", "lookup"] = Field(
        description="Synthetic task (megatron_rl.data.synthetic_task); lookup needs the synthetic_tool_calls episode."
    )
    prompt_format: Literal["text", "chat"] = Field(
        "text", description="Plain-string prompts, or chat messages rendered by the task tokenizer's template."
    )
    num_train: PositiveInt = Field(4096, description="Training prompts to generate.")
    num_val: PositiveInt = Field(256, description="Validation prompts to generate.")
    seed: int = Field(0, description="Seed of the generator.")


REMOTE_REWARD = "remote"
"""The ``data.reward`` value that scores through the server at ``data.remote_reward.url`` (a reserved name)."""


class RemoteRewardConfig(Section):
    """A reward server scoring each response over HTTP (``data.reward: remote``), in slime's ``--rm-url`` shapes.

    Each reward worker (``data.reward_num_workers``) POSTs one response at a time over one kept-alive connection
    of its own, so at most that many requests are in flight. Request: ``{"prompt", "response", "label"
    (the ground truth), "metadata" (the row's extra_info)}``. Answer: a JSON number (the score), or an object
    holding the score under ``score_key`` and optionally ``"correct"`` (bool) and ``"answer"`` (str or null).
    """

    url: str = Field(description="URL the requests are POSTed to, e.g. http://rm-host:8000/score (slime's --rm-url).")
    timeout_s: PositiveFloat = Field(
        8.0, description="Seconds one request may wait to connect and for each read of the answer."
    )
    retries: NonNegativeInt = Field(
        2,
        description="Retries of a request after a connection error, a timeout or a 5xx/429 answer; a request that "
        "still fails scores the response as failed (rollout/reward_errors). All tries and the waits between them "
        "must fit in data.reward_timeout_s (validate refuses a recipe where they cannot).",
    )
    backoff_s: float = Field(
        0.5,
        ge=0.0,
        description="Wait before the first retry; each later one waits twice as long, at most max_backoff_s, "
        "times a random factor in [0.5, 1] (jitter, so workers do not retry in lockstep).",
    )
    max_backoff_s: float = Field(4.0, ge=0.0, description="The most one wait between retries may be (before jitter).")
    score_key: str = Field(
        "score", min_length=1, description="Key of the score in an object answer (slime's --reward-key)."
    )
    correct_threshold: float = Field(
        0.5,
        description="A response is correct when its score is >= this, unless the answer object says 'correct'. "
        "0.5 splits both 0/1 and +1/-1 rewards.",
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        try:
            parts = urlsplit(url)
            valid = (
                parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port is None or parts.port > 0)
            )
        except ValueError:  # .port of a port that is no number, or out of range
            valid = False
        if not valid:
            raise ValueError(f"{url!r} is not an http:// or https:// URL with a host; e.g. http://rm-host:8000/score")
        return url

    def backoff_ceiling_s(self, retry: int) -> float:
        """The longest wait before retry ``retry`` (0 for the first): ``backoff_s`` doubled per retry, capped."""
        return min(self.backoff_s * 2.0**retry, self.max_backoff_s)

    @property
    def worst_case_s(self) -> float:
        """The longest a response's requests can take: every try timing out, every wait at its ceiling."""
        waits = sum(self.backoff_ceiling_s(retry) for retry in range(self.retries))
        return (self.retries + 1) * self.timeout_s + waits


JUDGE_REWARD = "judge"
"""The ``data.reward`` value that scores with the judge model of the ``judge:`` section (a reserved name)."""
JUDGE_FIELDS = ("prompt", "response", "ground_truth")
"""The placeholders a judge prompt template may use."""


class JudgeConfig(Section):
    """A judge model scoring each response (``data.reward: judge``), served by engines of the job's own.

    The judge's engines sit on their own placement (extra nodes on GPU recipes) and keep their weights: training
    never syncs them. Each response is asked about in ``prompt_template`` (``{prompt}``, ``{response}``,
    ``{ground_truth}``), rendered as a user message of the judge tokenizer's chat template when it has one, and
    answered greedily; the verdict is the last match of ``correct_pattern`` or ``wrong_pattern`` in the answer.
    An answer matching neither is a reward error (scored as the empty response, counted in
    rollout/reward_errors); the empty response is wrong without asking.
    """

    model: str = Field(description="Hugging Face directory of the judge model (weights, config, tokenizer).")
    engine: Literal["sglang", "reference"] | None = Field(
        None, description="Engine serving the judge; defaults to rollout.engine."
    )
    tp: PositiveInt = Field(1, description="Tensor-parallel size of each judge engine (GPUs per engine).")
    num_engines: PositiveInt = Field(
        1,
        description="Judge engines. On GPU recipes num_engines x tp GPUs fill whole extra nodes beside "
        "cluster.nodes (an allocation of cluster.nodes + judge nodes); responses go to them in turn.",
    )
    prompt_template: str = Field(
        "Question: {prompt}\nReference answer: {ground_truth}\nResponse: {response}\n"
        "Is the response's final answer equivalent to the reference answer? End with 'Verdict: correct' or "
        "'Verdict: wrong'.",
        description="What the judge is asked; {prompt}, {response} and {ground_truth} are filled in "
        "({response} is required).",
    )
    correct_pattern: str = Field(
        r"(?i)verdict:\s*correct", description="Regular expression of a 'correct' verdict in the judge's answer."
    )
    wrong_pattern: str = Field(
        r"(?i)verdict:\s*wrong", description="Regular expression of a 'wrong' verdict in the judge's answer."
    )
    max_new_tokens: PositiveInt = Field(512, description="Most tokens the judge may write per verdict.")
    correct_score: float = Field(1.0, description="Reward of a response judged correct.")
    wrong_score: float = Field(0.0, description="Reward of a response judged wrong (and of the empty response).")
    request_timeout_s: PositiveFloat = Field(
        25.0,
        description="Seconds one judge request may take before the next engine is tried; at most "
        "data.reward_timeout_s, after which the reward worker is killed (raise both for a slow judge).",
    )
    max_total_tokens: PositiveInt | None = Field(
        None, description="KV cache tokens per judge engine; defaults to rollout.max_total_tokens."
    )

    @field_validator("prompt_template")
    @classmethod
    def _known_fields(cls, template: str) -> str:
        try:
            fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
        except ValueError as exc:
            raise ValueError(f"{template!r} is not a format string ({exc}); write literal braces as {{{{ }}}}") from exc
        unknown = sorted(fields - set(JUDGE_FIELDS))
        if unknown:
            raise ValueError(f"unknown placeholders {unknown}: use only {{prompt}}, {{response}}, {{ground_truth}}")
        if "response" not in fields:
            raise ValueError("the template must contain {response}, the response the judge judges")
        return template

    @field_validator("correct_pattern", "wrong_pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"{pattern!r} is not a regular expression: {exc}") from exc
        return pattern


LoRATarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""A module LoRA adapts, by its Hugging Face / PEFT name. The MLP names cover whatever MLP a layer has: the dense
MLP of a dense layer, every routed expert of a MoE layer (PEFT matches ``experts.<e>.gate_proj`` by its suffix,
and SGLang 0.5.23 wraps a layer's FusedMoE under the same ``gate_up_proj``/``down_proj`` targets)."""
LORA_TARGETS: tuple[LoRATarget, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAConfig(Section):
    """Low-rank adapters trained on a frozen base (issue 40): only the adapters get gradients, optimizer state and
    weight syncs; the engines serve the base with the adapter (SGLang's --enable-lora).

    Cross-field checks (what SGLang 0.5.23 can serve) are in :func:`megatron_rl.config.checks._check_lora`.
    """

    rank: PositiveInt = Field(description="Rank r of every adapter (A: r x in, B: out x r).")
    # A fixed alpha, not one that grows with the rank: the update is scaled by alpha / r, so with a fixed alpha the
    # best learning rate barely moves with the rank ("LoRA Without Regret", Thinking Machines 2025, which used 32 and
    # found RL at ~10x the full fine-tuning learning rate); PEFT and SGLang read lora_alpha as given.
    alpha: PositiveFloat = Field(
        32.0, description="LoRA alpha: the adapter's update B A x is scaled by alpha / rank (PEFT's lora_alpha)."
    )
    target_modules: list[LoRATarget] = Field(
        default_factory=lambda: list(LORA_TARGETS),
        min_length=1,
        description="Modules with an adapter, by Hugging Face name: attention q_proj, k_proj, v_proj, o_proj; "
        "gate_proj, up_proj, down_proj of the dense MLP in a dense layer and of every routed expert in a MoE "
        "layer. Default: all seven (PEFT's all-linear without lm_head).",
    )
    experts_shared_outer: bool = Field(
        False,
        description="MoE layers: one gate_proj/up_proj A and one down_proj B shared by all experts of a layer, the "
        "per-expert B (gate/up) and A (down) their own (SGLang's --experts-shared-outer-loras); false: every expert "
        "has its own A and B.",
    )
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="LoRA dropout; must stay 0 for RL (a recipe check): the engines sample without dropout, so the "
        "trainer's log-probs must be those of the same deterministic adapter.",
    )
    max_loras_per_batch: PositiveInt = Field(
        1,
        description="SGLang's --max-loras-per-batch: adapter slots each engine GPU allocates. Every request of a "
        "step carries the policy's one adapter and syncs run between generations, so 1 suffices; each slot costs "
        "an adapter's bytes per GPU (`plan` counts them).",
    )

    @field_validator("target_modules")
    @classmethod
    def _no_repeats(cls, targets: list[LoRATarget]) -> list[LoRATarget]:
        if len(set(targets)) != len(targets):
            raise ValueError(f"{targets} names a module twice")
        return targets


class DataConfig(Section):
    """Prompt datasets and the reward."""

    train_files: list[str] = Field(default_factory=list, description="Parquet files of training prompts.")
    val_files: list[str] = Field(default_factory=list, description="Parquet files of validation prompts.")
    synthetic: SyntheticDataConfig | None = Field(None, description="Generate a synthetic task instead of files.")
    prompt_key: str = Field("prompt", description="Column with the prompt (string or chat messages).")
    answer_key: str = Field("reward_model.ground_truth", description="Dotted column path of the reference answer.")
    apply_chat_template: bool = Field(
        True,
        description="Wrap plain-string prompts as a user message of the tokenizer's chat template "
        "(chat-message prompts always go through it).",
    )
    reward: str = Field(
        "math_dapo",
        description="Registered reward name, an import path `pkg.module:function`, `remote`: a reward server "
        "(data.remote_reward), or `judge`: the judge model of the judge section.",
    )
    remote_reward: RemoteRewardConfig | None = Field(
        None, description="The reward server, required with data.reward: remote (and only then)."
    )
    reward_num_workers: PositiveInt = Field(
        4,
        description="Processes that score responses; with data.reward: remote also the requests in flight to the "
        "server (one kept-alive connection per process).",
    )
    reward_timeout_s: PositiveFloat = Field(
        30.0,
        description="Seconds the reward may take on one response. A response whose reward runs longer, or "
        "raises, scores as failed (the reward's score of the empty response, not correct), is counted in "
        "rollout/reward_timeouts or rollout/reward_errors and logged, and the run goes on; a hung reward's "
        "worker process is killed and replaced.",
    )
    shuffle: bool = Field(True, description="Shuffle prompts each epoch (seeded by train.seed).")

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if self.synthetic is None and not self.train_files:
            raise ValueError("set data.train_files (parquet) or data.synthetic")
        if self.synthetic is not None and (self.train_files or self.val_files):
            raise ValueError("data.synthetic generates its own files: leave data.train_files and data.val_files empty")
        return self


class TrainConfig(Section):
    """Optimisation: batch sizes, schedule, precision."""

    steps: PositiveInt = Field(description="Total optimizer steps of the run (each step is one rollout batch).")
    prompts_per_step: PositiveInt = Field(description="Prompts (groups) per step after dynamic-sampling filtering.")
    mini_batches_per_step: PositiveInt = Field(1, description="Optimizer updates per PPO epoch (1: on-policy).")
    ppo_epochs: PositiveInt = Field(1, description="Passes over each step's batch.")
    max_tokens_per_micro_batch: PositiveInt = Field(8192, description="Token budget of a micro-batch per DP rank.")
    logprob_chunk_tokens: int = Field(
        4096,
        ge=0,
        description="Log-probs and entropy are computed over at most this many tokens at once (recomputed per "
        "chunk in backward), bounding the [tokens, vocab/tp] softmax working set; 0: the whole micro-batch at once.",
    )
    pack_sequences: bool = Field(
        True,
        description="Pack each micro-batch's sequences into one THD stream (GPU with Transformer Engine only; "
        "elsewhere, or when false, micro-batches are padded to one [rows, seq] shape).",
    )
    lr: PositiveFloat = Field(1e-6, description="Peak learning rate.")
    min_lr: float = Field(0.0, ge=0.0, description="Final learning rate of the cosine schedule.")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="After warmup.")
    warmup_steps: int = Field(
        0,
        ge=0,
        description="Linear warmup, in rollout steps (each is mini_batches_per_step x ppo_epochs optimizer updates; "
        "the schedule warms up over all of them). DAPO's paper: 20.",
    )
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    adam_beta1: float = Field(0.9, gt=0.0, lt=1.0, description="Adam beta1.")
    adam_beta2: float = Field(0.999, gt=0.0, lt=1.0, description="Adam beta2.")
    adam_eps: PositiveFloat = Field(1e-8, description="Adam epsilon.")
    grad_clip: PositiveFloat | None = Field(1.0, description="Global gradient-norm clip, or off.")
    max_consecutive_bad_steps: PositiveInt = Field(
        3,
        description="An update whose loss or gradients are NaN/Inf is skipped and counted "
        "(`train/nonfinite_updates`); after this many steps in a row with a skipped update the run stops, "
        "naming the step and the metric (the last checkpoint is kept).",
    )
    max_staleness: NonNegativeInt = Field(
        0,
        description="Weight versions a step's samples may lag behind the policy they train (0: the synchronous "
        "loop). With s > 0 and disaggregated engines, step k+s is generated (with the weights after step k-1) "
        "while step k trains, so every sample of a step j > s comes from the weights after step j-s-1.",
    )
    seed: int = Field(1234, description="Seed of sampling order, initialisation and generation.")
    precision: Literal["bf16", "fp32", "fp8"] = Field("bf16", description="Training precision.")
    fp8_recipe: Literal["delayed", "tensorwise", "blockwise", "mxfp8"] | None = Field(
        None, description="Transformer Engine FP8 recipe; required with precision fp8."
    )
    recompute: Literal["none", "selective", "full"] = Field("none", description="Activation recomputation.")
    moe_aux_loss_type: Literal["none", "aux_loss", "seq_aux_loss", "global_aux_loss"] = Field(
        "none", description="MoE load-balancing loss (off by default for RL)."
    )
    moe_aux_loss_coef: float = Field(0.0, ge=0.0, description="Coefficient of the MoE load-balancing loss.")


class ValidationSetConfig(Section):
    """One validation set: its prompts, how they are sampled, and the k of its pass@k and maj@k."""

    files: list[str] = Field(
        default_factory=list,
        description="Parquet files of the set's prompts; empty: data.val_files (or data.synthetic's validation split).",
    )
    n: PositiveInt = Field(1, description="Responses per prompt (DAPO reports AIME 2024 at n=32: avg@32).")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature (0: greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass (DAPO's evaluation: 0.7).")
    top_k: TopK = Field(-1, ge=-1, description="Top-k sampling; -1 disables it.")
    max_response_length: PositiveInt | None = Field(
        None, description="Maximum new tokens per response; None: rollout.max_response_length."
    )
    ks: list[PositiveInt] = Field(
        default_factory=list,
        description="The k of pass@k (unbiased estimator) and maj@k (majority vote over the reward's extracted "
        "answers), each <= n; mean@n is always reported.",
    )
    interval: NonNegativeInt | None = Field(
        None,
        description="Validate this set every N steps; None: validation.interval; 0: never during training "
        "(`megatron-rl eval` still runs it).",
    )

    @model_validator(mode="after")
    def _ks_within_n(self) -> ValidationSetConfig:
        if any(k > self.n for k in self.ks):
            raise ValueError(f"ks {self.ks} has a k above n={self.n}: pass@k and maj@k draw k of the n responses")
        return self


class ValidationConfig(Section):
    """Named validation sets, each sampled and scored on its own, reported as ``val/<set>/<metric>``."""

    interval: NonNegativeInt = Field(
        0,
        description="Validate every N steps, before step 1 and after the last step too (0: never, whatever the "
        "sets' own intervals).",
    )
    sets: dict[str, ValidationSetConfig] = Field(
        default_factory=lambda: {"greedy": ValidationSetConfig()},
        min_length=1,
        description="Set name -> set. Names are letters, digits, `_` and `-` (they name metrics and files).",
    )

    @field_validator("sets")
    @classmethod
    def _names_are_simple(cls, sets: dict[str, ValidationSetConfig]) -> dict[str, ValidationSetConfig]:
        for name in sets:
            if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
                raise ValueError(f"set name {name!r} must be letters, digits, '_' and '-' (it names metrics and files)")
        return sets

    def interval_of(self, name: str) -> int:
        """How often set ``name`` runs during training, in steps (0: never)."""
        if self.interval == 0:
            return 0
        own = self.sets[name].interval
        return self.interval if own is None else own


class CheckpointConfig(Section):
    """Distributed checkpoints and resume."""

    dir: str | None = Field(None, description="Checkpoint directory; defaults to runs/<name>/checkpoints.")
    interval: int = Field(0, ge=0, description="Save every N steps (0: only at the end).")
    keep_last: PositiveInt = Field(2, description="Checkpoints to keep.")
    resume: str = Field("auto", description="auto (from `latest` when present), none, or a checkpoint path.")
    export_hf: bool = Field(False, description="Also write Hugging Face safetensors at each save.")


class ClusterConfig(Section):
    """The machines of the job."""

    nodes: PositiveInt = Field(1, description="Nodes in the allocation.")
    gpus_per_node: int = Field(8, ge=0, description="GPUs per node; 0 runs on CPU.")
    cpu_trainer_ranks: PositiveInt = Field(1, description="Trainer ranks when gpus_per_node is 0.")
    cpu_engines: PositiveInt = Field(
        1, description="Rollout engines (reference engine processes) when gpus_per_node is 0."
    )
    gpu_arch: Literal["hopper", "blackwell"] = Field(
        "hopper",
        description="GPU architecture of the nodes: hopper (H100/H200, compute capability 9.0) or blackwell "
        "(B200/GB200, 10.0). Decides which FP8 recipes can run: mxfp8 needs blackwell.",
    )
    network_interface: str | None = Field(
        None,
        description="The network interface the nodes reach each other on (e.g. ib0, eth0; `ip -brief addr` lists "
        "them), required when nodes > 1: engines, the weight transport, the trainer's process groups and the Slurm "
        "bootstrap's Ray listen on its address on each node, never on every interface. A one-node run ignores it "
        "and listens on 127.0.0.1 only.",
    )

    @field_validator("network_interface")
    @classmethod
    def _an_interface_name(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            ipaddress.ip_address(value.strip("[]"))
        except ValueError:
            pass
        else:
            raise ValueError(
                f"name the interface (e.g. ib0 or eth0), not an address: {value!r}; its address on each node is "
                "looked up there (a wildcard such as 0.0.0.0 would listen on every interface)"
            )
        if not value or len(value) > 15 or any(c.isspace() or c in "/*" for c in value):
            raise ValueError("a Linux interface name: 1 to 15 characters, no spaces, '/' or '*' (e.g. ib0)")
        return value


MetricSink = Literal["console", "jsonl", "tensorboard", "wandb"]


def _default_sinks() -> list[MetricSink]:
    return ["console", "jsonl", "tensorboard"]


class LoggingConfig(Section):
    """Metric sinks."""

    dir: str | None = Field(None, description="Log directory; defaults to runs/<name>/logs.")
    sinks: list[MetricSink] = Field(default_factory=_default_sinks, description="Where metrics go.")
    wandb_project: str | None = Field(None, description="W&B project when the wandb sink is on.")


class RunConfig(Section):
    """A whole run. Build it with :func:`megatron_rl.config.load_recipe`, which also runs the cross-field checks."""

    name: str = Field(description="Run name; default output folders are runs/<name>/.")
    model: ModelConfig
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    data: DataConfig
    train: TrainConfig
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    judge: JudgeConfig | None = Field(None, description="The judge model, required with data.reward: judge.")
    lora: LoRAConfig | None = Field(
        None, description="Train low-rank adapters on a frozen base instead of every parameter; None: full training."
    )

    @property
    def run_dir(self) -> str:
        """``runs/<name>``: default home of checkpoints and logs, and where prepared data is written."""
        return f"runs/{self.name}"

    @property
    def checkpoint_dir(self) -> str:
        """Checkpoint directory after defaulting to ``runs/<name>/checkpoints``."""
        return self.checkpoint.dir or f"{self.run_dir}/checkpoints"

    @property
    def log_dir(self) -> str:
        """Log directory after defaulting to ``runs/<name>/logs``."""
        return self.logging.dir or f"{self.run_dir}/logs"

    @property
    def rollout_fp8_dir(self) -> str | None:
        """With FP8 rollouts, the FP8 checkpoint the engines start from: ``rollout.fp8_checkpoint``, else
        ``<run_dir>/rollout_fp8`` (converted at run start); None without."""
        if self.rollout.quantization != "fp8":
            return None
        return self.rollout.fp8_checkpoint or f"{self.run_dir}/rollout_fp8"

    @property
    def judge_nodes(self) -> int:
        """Nodes of the judge's own beside ``cluster.nodes``: its engines' GPUs in whole nodes (0 on CPU recipes,
        where the judge shares the job's node, and without a judge)."""
        if self.judge is None or self.cluster.gpus_per_node == 0:
            return 0
        return -(-self.judge.num_engines * self.judge.tp // self.cluster.gpus_per_node)

    @property
    def job_nodes(self) -> int:
        """The job's nodes: ``cluster.nodes`` plus :attr:`judge_nodes` (what an allocation must hold)."""
        return self.cluster.nodes + self.judge_nodes

    @property
    def loss_norm_constant(self) -> int:
        """Dr.GRPO's divisor after defaulting to the maximum response length."""
        return self.algorithm.loss_norm_constant or self.rollout.max_response_length

    @property
    def engine_tp_ranks(self) -> int:
        """The TP ranks a weight transport addresses in one engine: ``rollout.tp`` for SGLang, 1 for the
        reference engine (one process whatever ``rollout.tp``)."""
        return self.rollout.tp if self.rollout.engine == "sglang" else 1

    @property
    def sglang_on_cpu(self) -> bool:
        """SGLang engines on a cluster without GPUs: SGLang's CPU path (``engines/sglang_cpu.py``)."""
        return self.rollout.engine == "sglang" and self.cluster.gpus_per_node == 0
