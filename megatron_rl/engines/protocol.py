"""The SGLang HTTP subset we speak: request bodies and generation results (target: sglang 0.5.23).

Each request dataclass maps to one endpoint and one SGLang request type (in
``sglang/srt/managers/io_struct.py``, 0.5.23); :meth:`to_json` gives the JSON
body, with field names and meanings identical to SGLang's. The SGLang client
(:mod:`~megatron_rl.engines.http_engine`) sends these bodies and the reference
server (:mod:`~megatron_rl.engines.reference.server`) parses them with the
same classes, so the client code that drives production engines is the code
under test.

``/generate`` answers one JSON object per sample (a list when the request had
``n > 1`` or was a batch): ``{"text", "output_ids", "meta_info": {"id", "finish_reason",
"prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
"output_token_logprobs": [[logprob, token_id, text | null], ...],
"routed_experts": base64 int32}}``. :class:`GenerateResult` parses one.
"""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self

import numpy as np

if TYPE_CHECKING:  # the recipe schema; the CLI imports engines and stays light
    from megatron_rl.config.schema import LoRAConfig

MemoryTag = Literal["weights", "kv_cache", "cuda_graph"]
PauseMode = Literal["abort", "retract", "in_place"]

FLUSH_CACHE_OK = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
"""The plain-text body (no JSON) of a successful ``/flush_cache`` (200), verbatim from SGLang 0.5.23."""
FLUSH_CACHE_FAILED = "Flush cache failed.\n"
"""The plain-text body of a refused ``/flush_cache`` (400: requests still running or queued)."""
MEMORY_TAGS: tuple[str, ...] = ("weights", "kv_cache", "cuda_graph")


class _Body:
    """JSON body helpers shared by the request dataclasses."""

    __dataclass_fields__: ClassVar[dict[str, Any]]  # every subclass is a dataclass

    def to_json(self) -> dict[str, Any]:
        """The request body: every field, None values included (SGLang's defaults match ours)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Self:
        """Parse a body; unknown keys raise ValueError naming them (SGLang ignores them, we do not)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(body) - names
        if unknown:
            raise ValueError(
                f"{cls.__name__}: unknown field(s) {sorted(unknown)}; expected a subset of {sorted(names)}"
            )
        return cls(**body)


@dataclass(frozen=True)
class SamplingParams(_Body):
    """SGLang ``sampling_params`` (the subset RL uses). ``top_k=-1`` and ``top_p=1`` disable those filters."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    no_stop_trim: bool = True
    skip_special_tokens: bool = False
    sampling_seed: int | None = None


@dataclass(frozen=True)
class GenerateRequest(_Body):
    """``POST /generate`` (SGLang ``GenerateReqInput``): one prompt's token ids, ``n`` samples.

    ``rid``: the request's id; with n > 1 a string names the group (sample i is ``{rid}_{i}``)
    and a list names each sample; None lets the engine name them.

    ``lora_path``: the NAME of a loaded LoRA adapter to generate with (SGLang's field name,
    ``io_struct.py:277``); None: the base model.

    ``sample_seeds``: one sampling seed per sample, in place of ``sampling_params.sampling_seed`` (which
    must then be None). Not a ``GenerateReqInput`` field: the body goes as a batch whose
    ``sampling_params`` is a list, one dict per sample with its own ``sampling_seed`` (SGLang 0.5.23's
    per-sample parameters; a single dict, or ``n`` in it, gives every sample the same seed).
    """

    input_ids: list[int]
    sampling_params: SamplingParams
    rid: str | list[str] | None = None
    return_logprob: bool = True
    logprob_start_len: int = -1
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    stream: bool = False
    sample_seeds: list[int] | None = None
    lora_path: str | None = None

    def __post_init__(self) -> None:
        if self.sample_seeds is not None:
            if len(self.sample_seeds) != self.sampling_params.n:
                raise ValueError(
                    f"GenerateRequest: {len(self.sample_seeds)} sample_seeds for n = {self.sampling_params.n} samples"
                )
            if self.sampling_params.sampling_seed is not None:
                raise ValueError("GenerateRequest: sample_seeds replace sampling_params.sampling_seed; set one of them")

    def sample_rids(self) -> list[str] | None:
        """Each sample's id on the engine, the ids ``/abort_request`` reaches (None when ``rid`` is None)."""
        if self.rid is None or isinstance(self.rid, list):
            return self.rid
        n = self.sampling_params.n
        return [self.rid] if n == 1 else [f"{self.rid}_{i}" for i in range(n)]

    def to_json(self) -> dict[str, Any]:
        """The body. n > 1 goes as a batch of n copies of the prompt, one sample each, ids ``sample_rids()``:
        SGLang 0.5.23 gives parallel samples (``n`` in the sampling params) fresh uuids and drops the rid,
        so no abort could reach them. With ``sample_seeds`` (any n) the batch's ``sampling_params`` is a list,
        sample i's dict carrying ``sampling_seed = sample_seeds[i]``."""
        body = super().to_json()
        seeds = body.pop("sample_seeds")
        n = self.sampling_params.n
        if n == 1 and not isinstance(self.rid, list) and seeds is None:
            return body
        params = {**body["sampling_params"], "n": 1}
        body["sampling_params"] = params if seeds is None else [params | {"sampling_seed": seed} for seed in seeds]
        return body | {"input_ids": [list(self.input_ids) for _ in range(n)], "rid": self.sample_rids()}

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> GenerateRequest:
        """Parse SGLang's single form or a batch that repeats one prompt with one sampling-params dict, or
        with one dict per entry that differ in ``sampling_seed`` only (``sample_seeds``).

        A single prompt with ``n > 1`` is SGLang's parallel sampling: its samples get fresh ids, so the
        parsed ``rid`` is None. ValueError names what else we do not serve (different prompts in a batch).
        """
        body = dict(body)
        if "sample_seeds" in body:
            raise ValueError("GenerateRequest: sample_seeds is not an SGLang field; send a list of sampling_params")
        raw_params = body.pop("sampling_params", None) or {}
        input_ids = body.get("input_ids")
        batch = input_ids if isinstance(input_ids, list) and input_ids else None
        if batch is not None and not all(isinstance(p, list) for p in batch):
            batch = None
        if isinstance(raw_params, list):
            params, body["sample_seeds"] = _per_sample_seeds(raw_params, None if batch is None else len(batch))
        else:
            params = SamplingParams.from_json(raw_params)
        if batch is not None:
            if params.n != 1 or any(p != batch[0] for p in batch):
                raise ValueError(
                    "GenerateRequest: a batched input_ids must repeat one prompt, with n = 1 in sampling_params "
                    "(one sample per entry); send different prompts as separate requests"
                )
            rid = body.get("rid")
            if rid is not None and (not isinstance(rid, list) or len(rid) != len(batch)):
                raise ValueError(f"GenerateRequest: a batch of {len(batch)} needs as many rids, got {rid!r}")
            params = dataclasses.replace(params, n=len(batch))
            body["input_ids"] = batch[0]
        elif params.n > 1:
            body["rid"] = None  # SGLang's parallel sampling names the samples itself
        request = super().from_json({**body, "sampling_params": params})
        if not request.input_ids or not all(isinstance(t, int) for t in request.input_ids):
            raise ValueError("GenerateRequest.input_ids must be a non-empty list of token ids (one prompt)")
        return request


def _per_sample_seeds(raw: list[dict[str, Any]], batch: int | None) -> tuple[SamplingParams, list[int]]:
    """A batch's list of sampling_params (``batch`` entries; None: not a batch) as the one set they share
    (``sampling_seed`` None) and each entry's seed; ValueError for anything else."""
    if batch is None or len(raw) != batch:
        raise ValueError(
            f"GenerateRequest: a list of sampling_params needs a batched input_ids of as many entries "
            f"(got {len(raw)} for {batch or 'no batch'})"
        )
    per_sample = [SamplingParams.from_json(p) for p in raw]
    shared = dataclasses.replace(per_sample[0], sampling_seed=None)
    seeds = [p.sampling_seed for p in per_sample]
    if any(dataclasses.replace(p, sampling_seed=None) != shared for p in per_sample) or None in seeds:
        raise ValueError(
            "GenerateRequest: per-sample sampling_params must differ in sampling_seed only, each setting one; "
            "send other differences as separate requests"
        )
    return shared, [int(seed) for seed in seeds if seed is not None]


@dataclass(frozen=True)
class UpdateWeightsFromTensorRequest(_Body):
    """``POST /update_weights_from_tensor``: one base64 payload per engine TP rank (see ``tensor_serialization``)."""

    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


@dataclass(frozen=True)
class LoadLoRAAdapterFromTensorsRequest(_Body):
    """``POST /load_lora_adapter_from_tensors`` (SGLang ``LoadLoRAAdapterFromTensorsReqInput``,
    ``io_struct.py:2548-2569``): register adapter ``lora_name`` from PEFT-named tensors.

    ``config_dict``: the PEFT ``adapter_config.json`` (``peft_type``, ``r``, ``lora_alpha``,
    ``target_modules``); ``serialized_named_tensors``: one base64 payload per engine TP rank, each
    the FULL unsharded PEFT dict: a pickled dict (:func:`~megatron_rl.wire.tensor_serialization.serialize_tensor_dict`;
    SGLang's loader calls ``.items()`` on it, so a list of pairs fails) or, with ``load_format="flattened_bucket"``,
    a flattened bucket. Not gated by weight-update sessions; sets no weight version.
    """

    lora_name: str
    config_dict: dict[str, Any]
    serialized_named_tensors: list[str]
    pinned: bool = False
    added_tokens_config: dict[str, int] | None = None
    lora_id: str | None = None
    load_format: str | None = None
    expected_checksums: dict[str, str] | None = None


@dataclass(frozen=True)
class LoadLoRAAdapterRequest(_Body):
    """``POST /load_lora_adapter`` (SGLang ``LoadLoRAAdapterReqInput``): register adapter ``lora_name`` from
    ``lora_path``, a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``) the engine reads."""

    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str | None = None


@dataclass(frozen=True)
class UnloadLoRAAdapterRequest(_Body):
    """``POST /unload_lora_adapter`` (SGLang ``UnloadLoRAAdapterReqInput``): forget adapter ``lora_name``."""

    lora_name: str
    lora_id: str | None = None


@dataclass(frozen=True)
class UpdateWeightVersionRequest(_Body):
    """``POST /update_weight_version`` (SGLang ``UpdateWeightVersionReqInput``, ``io_struct.py:2155-2159``): the
    version generation results report from now on (``meta_info.weight_version``), weights unchanged. SGLang's LoRA
    endpoints set no version, so an adapter sync reports its own through this. ``abort_all_requests`` defaults to
    True as SGLang's does (every request in flight is aborted); a sync sends False."""

    new_version: str
    abort_all_requests: bool = True


@dataclass(frozen=True)
class LoRASettings:
    """SGLang's ``--max-lora-rank``, ``--lora-target-modules`` and ``--max-loras-per-batch``: what adapters the
    engine accepts and how many distinct ones (the base model counting as one) a batch may mix (SGLang's default 8)."""

    max_rank: int
    target_modules: tuple[str, ...]
    max_loras_per_batch: int = 8

    @classmethod
    def of(cls, lora: LoRAConfig) -> LoRASettings:
        """The settings a recipe's ``lora:`` section starts its engines with: its rank as the largest accepted, its
        targets, its slots per batch."""
        return cls(lora.rank, tuple(lora.target_modules), lora.max_loras_per_batch)


LORA_ADAPTER_PREFIX = "policy-v"
"""Adapter names are ``policy-v{weight version}``: one name per synced version (``docs/lora-sync.md``)."""


def lora_adapter_name(version: str | int) -> str:
    """The name the engines serve the policy's adapter of weight version ``version`` under (``policy-v{version}``);
    every generate request of a LoRA run names it in ``lora_path``."""
    return f"{LORA_ADAPTER_PREFIX}{version}"


@dataclass(frozen=True)
class LoRAUpdateResult:
    """The answer of the three LoRA endpoints (SGLang ``LoRAUpdateOutput``, ``io_struct.py:2572-2580``), HTTP 200
    when ``success`` else 400: ``loaded_adapters`` maps each loaded name to its path (``"__tensor__"`` for an
    adapter loaded from tensors)."""

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, str] | None = None

    def to_json(self) -> dict[str, Any]:
        """The body SGLang answers."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> LoRAUpdateResult:
        """Parse an answer (200 or 400)."""
        return cls(body["success"], body.get("error_message"), body.get("loaded_adapters"))


@dataclass(frozen=True)
class BeginWeightUpdateRequest(_Body):
    """``POST /begin_weight_update`` (SGLang ``BeginWeightUpdateReqInput``): open the weight-update session.

    In 0.5.23 ``/update_weights_from_tensor`` and ``/update_weights_from_distributed`` fail
    (400) outside a session; one session at a time per engine (a second begin is a 400).
    """

    selector: Literal["target", "draft", "all"] = "all"


@dataclass(frozen=True)
class EndWeightUpdateRequest(_Body):
    """``POST /end_weight_update`` (SGLang ``EndWeightUpdateReqInput``): close the session; the engine
    post-processes the loaded weights there (SGLang 0.5.23: each quantised layer's
    ``process_weights_after_loading``, which re-quantises block FP8 scales to UE8M0 on Blackwell only; on
    Hopper the FP8 weights and ``weight_scale_inv`` stay as sent). A 400 when no session is open."""


@dataclass(frozen=True)
class InitWeightsUpdateGroupRequest(_Body):
    """``POST /init_weights_update_group``: engine rank ``i`` joins as ``rank_offset + i``; the trainer is rank 0."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


@dataclass(frozen=True)
class DestroyWeightsUpdateGroupRequest(_Body):
    """``POST /destroy_weights_update_group``."""

    group_name: str = "weight_update_group"


@dataclass(frozen=True)
class UpdateWeightsFromDistributedRequest(_Body):
    """``POST /update_weights_from_distributed``: the engine receives one ``broadcast(src=0)`` per name, in order,
    or with ``load_format="flattened_bucket"`` one broadcast of them all packed back to back
    (:mod:`~megatron_rl.wire.dense_buckets`).

    ``dtypes`` are torch dtype names without the ``torch.`` prefix (``"float32"``, ``"bfloat16"``).
    """

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


@dataclass(frozen=True)
class UpdateWeightsFromDiskRequest(_Body):
    """``POST /update_weights_from_disk``: reload every weight from a Hugging Face directory."""

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


@dataclass(frozen=True)
class MemoryOccupationRequest(_Body):
    """``POST /release_memory_occupation`` and ``/resume_memory_occupation``; ``tags=None`` means all."""

    tags: list[str] | None = None

    def __post_init__(self) -> None:
        unknown = set(self.tags or ()) - set(MEMORY_TAGS)
        if unknown:
            raise ValueError(f"memory tags {sorted(unknown)} are not among {list(MEMORY_TAGS)}")


@dataclass(frozen=True)
class PauseGenerationRequest(_Body):
    """``POST /pause_generation``: abort in-flight requests, or hold them (``retract``/``in_place``)."""

    mode: PauseMode = "abort"


@dataclass(frozen=True)
class AbortRequest(_Body):
    """``POST /abort_request``: one request id, or all requests."""

    rid: str = ""
    abort_all: bool = False


@dataclass(frozen=True)
class GetWeightsByNameRequest(_Body):
    """``POST /get_weights_by_name``: a weight by its Hugging Face name (nested lists, first ``truncate_size`` rows)."""

    name: str
    truncate_size: int = 100


@dataclass(frozen=True)
class CheckWeightsRequest(_Body):
    """``POST /weights_checker`` (SGLang's ``CheckWeightsReqInput``): ``action`` is ``snapshot`` (copy every
    weight), ``reset_tensors`` (overwrite them with random values), ``compare`` (against the snapshot, bit for
    bit; ``allow_quant_error``: FP8 weights may differ within their quantisation ULPs) or ``checksum``;
    ``skip_tensor_list``: substrings of the tensor names to leave out; ``selector``: the target model, its
    draft model, or all."""

    action: str = "checksum"
    allow_quant_error: bool = False
    skip_tensor_list: list[str] | None = None
    selector: Literal["target", "draft", "all"] = "all"


@dataclass(frozen=True)
class FinishReason:
    """Why a sample ended: ``stop`` (a stop token, ``matched``), ``length`` (max_new_tokens) or ``abort``."""

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    message: str | None = None

    def to_json(self) -> dict[str, Any]:
        if self.type == "length":
            return {"type": "length", "length": None}
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        return {"type": "abort", "message": self.message}


@dataclass(frozen=True)
class GenerateResult:
    """One sample of a ``/generate`` answer.

    ``output_logprobs[i]`` is the engine's log-prob of ``output_ids[i]``.
    ``routed_experts``: int32 ``[prompt_len + len(output_ids) - 1 - start, num_layers, top_k]``,
    the experts every token fed through the model was routed to (None unless asked).
    """

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: FinishReason
    prompt_tokens: int
    weight_version: str | None
    rid: str | None = None
    routed_experts: np.ndarray | None = field(default=None, compare=False)

    @property
    def aborted(self) -> bool:
        """True when the engine aborted this sample (pause, abort request, shutdown)."""
        return self.finish_reason.type == "abort"

    @classmethod
    def from_json(cls, body: dict[str, Any], *, routed_experts_shape: tuple[int, int] | None = None) -> GenerateResult:
        """Parse one sample; ``routed_experts_shape`` = (num_layers, top_k) decodes the base64 routing buffer."""
        meta = body["meta_info"]
        output_ids = list(body["output_ids"])
        logprobs = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
        if logprobs and len(logprobs) != len(output_ids):
            raise ValueError(f"engine returned {len(logprobs)} log-probs for {len(output_ids)} output tokens")
        reason = meta.get("finish_reason") or {"type": "abort", "message": "no finish_reason"}
        routed = meta.get("routed_experts")
        if routed is not None and routed_experts_shape is not None:
            routed = decode_routed_experts(routed, routed_experts_shape)
        return cls(
            output_ids=output_ids,
            output_logprobs=logprobs,
            finish_reason=FinishReason(reason["type"], reason.get("matched"), reason.get("message")),
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            weight_version=meta.get("weight_version"),
            rid=meta.get("id"),
            routed_experts=routed if isinstance(routed, np.ndarray) else None,
        )


def encode_routed_experts(routed: np.ndarray) -> str:
    """int32 ``[tokens, layers, top_k]`` -> base64 of its raw bytes (SGLang's wire format)."""
    return base64.b64encode(np.ascontiguousarray(routed, dtype=np.int32).tobytes()).decode("ascii")


def decode_routed_experts(encoded: str, shape: tuple[int, int]) -> np.ndarray:
    """Inverse of :func:`encode_routed_experts`; ``shape`` = (num_layers, top_k) of one token."""
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    per_token = shape[0] * shape[1]
    if flat.size % per_token:
        raise ValueError(f"routed_experts holds {flat.size} ids, not a multiple of layers x top_k = {per_token}")
    return flat.reshape(-1, *shape).copy()


FORWARD_SECONDS_METRIC = "sglang:forward_execution_seconds_total"
"""SGLang's counter (``GET /metrics`` with ``--enable-metrics``) of seconds spent in forward passes, by forward mode."""
IDLE_SECONDS_METRIC = "sglang:scheduler_idle_seconds_total"
"""SGLang's counter of wall seconds its scheduler had no runnable or queued work."""


def metric_samples(prometheus_text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of metric ``name`` in a ``/metrics`` answer (Prometheus text format)."""
    samples = []
    for line in prometheus_text.splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line[len(name) + 1 :].rpartition("} ")
        elif line.startswith(name + " "):
            labels, value = "", line[len(name) + 1 :]
        else:
            continue
        pairs = (item.split("=", 1) for item in labels.split(",") if "=" in item)
        samples.append(({key: raw.strip('"') for key, raw in pairs}, float(value)))
    return samples


def metric_total(prometheus_text: str, name: str) -> float:
    """The sum of every sample of metric ``name`` (all labels: forward modes, ranks); 0 when absent."""
    return sum(value for _, value in metric_samples(prometheus_text, name))
