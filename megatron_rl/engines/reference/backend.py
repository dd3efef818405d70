"""State and operations of the reference engine (the HTTP layer is ``reference.server``).

It enforces SGLang 0.5.23's protocol (each rule names its SGLang source in
``docs/architecture.md``, "The reference engine as SGLang's twin"):

- weight updates from tensors or by broadcast run only inside a weight-update
  session (``begin_weight_update`` ... ``end_weight_update``, one at a time),
  else :class:`WeightUpdateRefused` (HTTP 400, ``success: false``);
- weight-update control requests (session, groups, updates) run one at a time,
  as SGLang's scheduler serves them: an engine blocked joining one broadcast
  group serves no other weight request until that group forms;
- ``flush_cache`` is refused while requests run or wait, unless generation is
  paused with ``retract`` (held requests then re-prefill on their next token);
- with ``dp_size > 1`` every weight update and group request fails SGLang's
  ``assert dp_size == 1`` (an AssertionError: HTTP 500);
- an update whose ``flush_cache`` flag is set fails after loading when the
  flush is refused, with SGLang's message.

Concurrency (continuous batching): any number of handler threads hand requests to
one scheduler thread, which admits them in arrival order while cache slots are free
(``max_running_requests`` samples) and runs one batched decode step after another for
all admitted requests (:mod:`generator`). A response does not depend on which requests
share its steps (the forward is batch-invariant, :mod:`slot_model`). Like SGLang: a
request longer than the context length is refused; a weight update outside a pause waits
until no request is in flight, and new requests wait while it waits or runs (SGLang's
``model_update_lock``); inside a pause it runs at once. A pause holds every admitted
request at its next step (admission goes on); ``in_place`` keeps its KV cache,
``retract`` lets a flush drop it (it then prefills again). Aborts are checked before
every step. One model lock serialises steps and weight writes. Memory release (CPU or
GPU): ``weights`` frees every parameter's storage (generation is refused until resumed
and updated: resumed weights are zeros, as with SGLang's memory saver without CPU
backup), ``kv_cache`` frees the KV cache (allocated again at the next step).
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file

from megatron_rl.engines.protocol import (
    MEMORY_TAGS,
    CheckWeightsRequest,
    FinishReason,
    GenerateRequest,
    InitWeightsUpdateGroupRequest,
    LoadLoRAAdapterFromTensorsRequest,
    LoadLoRAAdapterRequest,
    LoRASettings,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightVersionRequest,
    encode_routed_experts,
)
from megatron_rl.engines.reference.fp8_weights import Fp8Weights
from megatron_rl.engines.reference.generator import RequestState, decode_step, eos_ids
from megatron_rl.engines.reference.lora_adapters import (
    TENSOR_PATH,
    LoRARegistry,
    read_peft_dir,
)
from megatron_rl.engines.reference.shared_buffers import SharedBufferMappings
from megatron_rl.engines.reference.slot_model import SlotModel
from megatron_rl.engines.reference.weight_checker import WeightChecker
from megatron_rl.engines.reference.weights import load_named_tensors, resolve_weight
from megatron_rl.wire.dense_buckets import empty_bucket
from megatron_rl.wire.fp8_blocks import SCALE_SUFFIX
from megatron_rl.wire.tensor_serialization import (
    FLATTENED_BUCKET,
    deserialize_payload,
    deserialize_tensors,
    shared_memory_owners,
)
from megatron_rl.wire.weight_group import (
    WeightGroup,
    broadcast_from_trainer,
    create_weight_group,
    destroy_weight_group,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from megatron_rl.engines.reference.generator import SampleOutput

logger = logging.getLogger(__name__)

FLUSH_POLL_S = 0.05
FLUSH_REFUSED_AFTER_UPDATE = (
    "Weights were updated, but the cache was not flushed because requests are still running or queued. "
    "Retract or finish them, then call /flush_cache."
)


class EngineStateError(RuntimeError):
    """The request cannot run in the engine's current state (answered with HTTP 400)."""


class WeightUpdateRefused(EngineStateError):
    """A weight-update request SGLang answers with ``{"success": false, "message"}`` and HTTP 400."""


DEFAULT_MAX_RUNNING_REQUESTS = 256
"""Cache slots (samples decoding at once) unless ``--max-running-requests`` says otherwise."""


class ReferenceBackend:
    """One model, its weight version, pause/abort state, weight-update session and groups.

    ``dp_size``: the data-parallel size the engine claims (SGLang's ``--dp-size``); above 1
    every weight update fails as SGLang's does. ``max_running_requests``: samples decoding at
    once (SGLang's ``--max-running-requests``; each sample of an n-sample request counts); a
    request with more samples than that runs alone, on slots added for it.
    ``context_length``: positions per sequence (SGLang's ``--context-length``; default the
    model's ``max_position_embeddings``). ``fp8_block``: serve FP8 weights of that block, as
    SGLang started from an FP8 checkpoint (:class:`Fp8Weights`): each update's FP8 weights and
    scales are kept and the model computes with their product. ``tp_rank`` of ``tp_size``: this
    process's rank in an engine of several node processes, one rank each
    (:mod:`~megatron_rl.engines.reference.node_group`): it joins weight groups at
    ``rank_offset + tp_rank`` and takes payload ``tp_rank`` of a tensor update, as SGLang's TP ranks do.
    ``lora``: serve LoRA adapters within these limits (SGLang's ``--enable-lora``,
    :mod:`~megatron_rl.engines.reference.lora_adapters`); None: LoRA not enabled.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        seed: int = 0,
        dp_size: int = 1,
        max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS,
        context_length: int | None = None,
        fp8_block: tuple[int, int] | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        lora: LoRASettings | None = None,
    ) -> None:
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} must be in [0, tp_size={tp_size})")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.model = model.eval()
        self.params = dict(model.named_parameters())
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.fp8 = None if fp8_block is None else Fp8Weights(fp8_block)
        self.lora = LoRARegistry(model, lora)
        self.weight_checker = WeightChecker(model, self.fp8, tp_rank=tp_rank, tp_size=tp_size)
        context = context_length or model.config.max_position_embeddings
        self.slot_model = SlotModel(model, slots=max_running_requests, context_length=context)
        self._eos = eos_ids(model)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.weight_version = "default"
        self._model_lock = threading.Lock()
        self._state = threading.Condition()
        self.dp_size = dp_size
        self._paused = False
        self._pause_mode = "abort"
        self._abort_epoch = 0
        self._cache_epoch = 0
        self._decoding = 0
        self._control = threading.Lock()
        self._session = False
        self._sender: int | None = None  # the process TP rank 0's tensors came from in this session
        self._last_sender: int | None = None
        self._aborted_rids: set[str] = set()
        self._active_rids: set[str] = set()
        self._in_flight = 0
        self._released: set[str] = set()
        self._shapes: dict[str, torch.Size] = {}
        self._groups: dict[str, WeightGroup] = {}
        self._shared_buffers = SharedBufferMappings()
        self._writers = 0
        self._jobs: dict[RequestState, tuple[int, list[str]]] = {}
        self._waiting: list[RequestState] = []
        self._running: list[RequestState] = []
        self._free_slots = list(range(max_running_requests))  # a heap: the lowest free slot first
        self.idle_seconds = 0.0
        """Wall seconds the scheduler waited with no request in the engine (SGLang's scheduler idle time)."""
        threading.Thread(target=self._schedule, name="reference-scheduler", daemon=True).start()

    def generate(self, request: GenerateRequest) -> dict[str, Any] | list[dict[str, Any]]:
        """SGLang ``/generate`` answer: one dict per sample (a list when n > 1 or the request was a batch).

        The request joins the batch the scheduler thread decodes; it returns when all its samples
        are done (or aborted). Like SGLang, it waits while a weight update waits or runs.
        """
        if request.stream:
            raise EngineStateError("the reference engine does not stream; send stream=false")
        if "weights" in self._released:
            raise EngineStateError("weights are released; call /resume_memory_occupation and update weights first")
        if request.sample_seeds is not None:
            raise ValueError(
                "the reference engine seeds a request, not each sample (its samples draw from one generator, "
                "always reproducibly): send sampling_params.sampling_seed instead of one per sample"
            )
        self._check_lengths(request)
        params = request.sampling_params
        sample_rids = request.sample_rids() or [uuid.uuid4().hex for _ in range(params.n)]
        generator = self.generator
        if params.sampling_seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.sampling_seed)
        routing_shape = None
        if request.return_routed_experts and self.slot_model.routes_experts:
            routing_shape = (self.slot_model.context_length, self.slot_model.num_layers, self.slot_model.top_k)
        stop_ids = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else self._eos)
        adapter = self.lora.acquire(request.lora_path)
        state = RequestState(request, generator, stop_ids, routing_shape, adapter)
        try:
            with self._state:
                self._state.wait_for(lambda: not self._writers)
                self._jobs[state] = (self._abort_epoch, sample_rids)
                self._waiting.append(state)
                self._in_flight += 1
                self._active_rids |= set(sample_rids)
                self._state.notify_all()
            try:
                state.done.wait()
            finally:
                with self._state:
                    self._in_flight -= 1
                    self._active_rids -= set(sample_rids)
                    self._aborted_rids -= set(sample_rids)
                    self._jobs.pop(state, None)
                    self._state.notify_all()
        finally:
            self.lora.release(adapter)
        if state.error is not None:
            raise state.error
        answers = [
            self._sample_json(sample_rids[i], i, s, len(request.input_ids), state.weight_version)
            for i, s in enumerate(state.results())
        ]
        return answers if params.n > 1 or isinstance(request.rid, list) else answers[0]

    def _check_lengths(self, request: GenerateRequest) -> None:
        """SGLang's context-length checks (``TokenizerManager._validate_input_ids_in_context_length``)."""
        context, prompt = self.slot_model.context_length, len(request.input_ids)
        if prompt >= context:
            raise ValueError(
                f"The input ({prompt} tokens) is longer than the model's context length ({context} tokens)."
            )
        max_new = request.sampling_params.max_new_tokens
        if max_new is not None and prompt + max_new > context:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {context} tokens. "
                f"You requested a total of {prompt + max_new} tokens: {prompt} tokens from the input messages and "
                f"{max_new} tokens for the completion. Please reduce the number of tokens in the input messages "
                "or the completion to fit within the limit."
            )

    def _stopped(self, state: RequestState) -> list[int]:
        """The samples of ``state`` an abort reached (every one after an abort-all or an abort pause)."""
        epoch, sample_rids = self._jobs[state]
        if self._abort_epoch != epoch:
            return list(range(state.n))
        return [i for i, rid in enumerate(sample_rids) if rid in self._aborted_rids]

    def _release_finished(self, states: list[RequestState]) -> None:
        """Hand back done requests (called with ``_state`` held)."""
        for state in states:
            if not state.running():
                state.weight_version = self.weight_version
                self._running.remove(state)
                state.done.set()
        self._decoding = len(self._running)

    def _admit_and_abort(self) -> None:
        """Abort stopped requests, admit waiting ones while slots are free (arrival order); ``_state`` held."""
        aborted = FinishReason("abort", message="aborted")
        for state in list(self._waiting):
            state.finish(aborted, self._stopped(state))
            if not state.running():
                self._waiting.remove(state)
                state.weight_version = self.weight_version
                state.done.set()
        for state in self._running:
            self._free(state.finish(aborted, self._stopped(state)))
        while self._waiting and (len(self._free_slots) >= len(self._waiting[0].running()) or not self._running):
            state = self._waiting.pop(0)
            samples = state.running()
            if len(self._free_slots) < len(samples):  # more samples than max_running_requests: it runs alone
                self._free(self.slot_model.add_slots(len(samples) - len(self._free_slots)))
            for i in samples:
                state.slots[i] = heapq.heappop(self._free_slots)
            state.cache_epoch = self._cache_epoch
            if state.request.sampling_params.max_new_tokens <= 0:
                self._free(state.finish(FinishReason("length")))
            self._running.append(state)
        self._release_finished(list(self._running))

    def _free(self, slots: list[int]) -> None:
        for slot in slots:
            heapq.heappush(self._free_slots, slot)

    def _schedule(self) -> None:
        """The scheduler thread: one batched decode step after another while requests run and no pause holds them."""
        while True:
            with self._state:
                while True:
                    self._admit_and_abort()
                    if self._running and not self._paused:
                        break
                    idle = not self._running and not self._waiting
                    waited = time.perf_counter()
                    self._state.wait()
                    if idle:
                        self.idle_seconds += time.perf_counter() - waited
            with self._model_lock:
                with self._state:  # re-checked under the model lock: a pause or flush may have come in between
                    self._admit_and_abort()
                    if self._paused or not self._running:
                        continue
                    states = list(self._running)
                    for state in states:
                        if state.cache_epoch != self._cache_epoch:
                            state.drop_cache()
                            state.cache_epoch = self._cache_epoch
                freed = self._step(states)
            with self._state:
                self._free(freed)
                self._release_finished(states)

    def _step(self, states: list[RequestState]) -> list[int]:
        """One batched decode step (model lock held); a failing step fails its requests, the engine goes on."""
        try:
            return decode_step(self.slot_model, states)
        except Exception as error:  # noqa: BLE001 - the handler threads re-raise it (HTTP 500)
            logger.error("decode step failed:\n%s", traceback.format_exc())
            freed = []
            for state in states:
                state.error = error
                freed += state.finish(FinishReason("abort", message=str(error)))
            return freed

    @staticmethod
    def _sample_json(rid: str, index: int, sample: SampleOutput, prompt_tokens: int, version: str) -> dict[str, Any]:
        """One sample's SGLang JSON, ``rid`` its id."""
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": sample.finish_reason.to_json(),
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(sample.output_ids),
            "cached_tokens": 0,
            "weight_version": version,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(sample.logprobs, sample.output_ids, strict=True)],
        }
        if sample.finish_reason.type == "length":
            meta["finish_reason"]["length"] = len(sample.output_ids)
        if sample.routed_experts is not None:
            meta["routed_experts"] = encode_routed_experts(sample.routed_experts)
        return {"text": "", "output_ids": sample.output_ids, "meta_info": meta, "index": index}

    def abort(self, rid: str, abort_all: bool) -> None:
        """Abort every running request, or the running one ``rid`` names, as SGLang does.

        As SGLang's tokenizer manager: a rid no running request registered is ignored (also one
        that arrives later). Each sample registers its own id (``GenerateRequest.sample_rids``; fresh
        ids for parallel sampling), and aborting one ends that sample only.
        """
        with self._state:
            if abort_all:
                self._abort_epoch += 1
            elif rid in self._active_rids:
                self._aborted_rids.add(rid)
            self._state.notify_all()

    def pause(self, mode: str) -> dict[str, Any]:
        """Hold generation at the next token; ``abort`` also aborts every running request (SGLang's answer)."""
        with self._state:
            self._paused = True
            self._pause_mode = mode
            if mode == "abort":
                self._abort_epoch += 1
            self._state.notify_all()
        return {"message": "Generation paused successfully.", "status": "ok"}

    def resume_generation(self) -> dict[str, Any]:
        """Let held and new requests run again (SGLang's answer)."""
        with self._state:
            self._paused = False
            self._state.notify_all()
        return {"message": "Generation continued successfully.", "status": "ok"}

    def _flushable(self) -> bool:
        """SGLang's ``is_fully_idle(ignore_waiting=paused)``: nothing decoding, or held by a retracting pause."""
        if not self._paused:
            return self._in_flight == 0
        return self._decoding == 0 or self._pause_mode in ("retract", "abort")

    def flush_cache(self, timeout_s: float = 0.0) -> bool:
        """Drop the (prefix) cache; False when refused (SGLang answers 400).

        ``timeout_s`` = 0: refused unless :meth:`_flushable`. ``timeout_s`` > 0 (SGLang's deferred
        flush): flush once no request is in flight at all, refused after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while timeout_s > 0:
            with self._state:
                if self._in_flight == 0:
                    break
            if time.monotonic() >= deadline:
                return False
            time.sleep(FLUSH_POLL_S)
        with self._model_lock, self._state:  # no step runs now: every admitted request is between steps
            if not self._flushable():
                return False
            self._cache_epoch += 1
        return True

    def release(self, tags: list[str] | None) -> None:
        """Release memory of ``tags`` (all when None); refused while requests run (as SGLang asserts)."""
        with self._state:
            if self._in_flight:
                raise EngineStateError(f"cannot release memory with {self._in_flight} request(s) running")
        with self._model_lock:
            for tag in tags or MEMORY_TAGS:
                if tag == "weights" and tag not in self._released:
                    for name, param in self.params.items():
                        self._shapes[name] = param.shape
                        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
                if tag == "kv_cache":
                    self.slot_model.drop_cache()
                self._released.add(tag)

    def resume(self, tags: list[str] | None) -> None:
        """Re-allocate released memory; resumed weights are zeros until updated."""
        with self._model_lock:
            for tag in tags or MEMORY_TAGS:
                if tag == "weights" and tag in self._released:
                    for name, param in self.params.items():
                        param.data = torch.zeros(self._shapes[name], dtype=param.dtype, device=param.device)
                self._released.discard(tag)

    def _load(self, named_tensors: list[tuple[str, torch.Tensor]], version: str | None, flush: bool) -> None:
        if "weights" in self._released:
            raise EngineStateError("weights are released; call /resume_memory_occupation before updating them")
        with self._state:
            self._writers += 1
        try:
            with self._state:  # SGLang's writer lock: unless paused, wait until no request is in flight
                self._state.wait_for(lambda: self._paused or self._in_flight == 0)
            with self._model_lock:
                if self.fp8 is not None:
                    named_tensors = self.fp8.absorb(named_tensors, self.dtype)
                load_named_tensors(self.params, named_tensors)
                if version is not None:
                    self.weight_version = version
        finally:
            with self._state:
                self._writers -= 1
                self._state.notify_all()
        if flush and not self.flush_cache():
            raise WeightUpdateRefused(FLUSH_REFUSED_AFTER_UPDATE)

    def _assert_single_dp(self, what: str) -> None:
        assert self.dp_size == 1, f"data-parallel replicas are not supported for {what}"

    def _require_session(self, endpoint: str) -> None:
        if not self._session:
            raise WeightUpdateRefused(f"{endpoint} must run between begin_weight_update() and end_weight_update()")

    def begin_weight_update(self) -> None:
        """Open the weight-update session; refused while one is open."""
        with self._control:
            if self._session:
                raise WeightUpdateRefused("a weight-update session is already open; call end_weight_update() first")
            self._session = True
            self._sender = None

    def end_weight_update(self) -> None:
        """Close the session (plain PyTorch weights need no post-processing); refused when none is open."""
        with self._control:
            if not self._session:
                raise WeightUpdateRefused("no weight-update session is open; call begin_weight_update() first")
            self._session = False
            self._shared_buffers.end_sync()

    def update_from_tensor(
        self, payloads: list[str], version: str | None, flush: bool = False, load_format: str | None = None
    ) -> None:
        """Load one serialized bucket: one payload per TP rank, this rank's is ``payloads[tp_rank]``; inside a
        session.

        ``load_format`` as SGLang's: None or ``"direct"`` (a list of named tensors; this engine loads
        by name either way) or ``"flattened_bucket"`` (one flat tensor and metadata); any other is
        refused (ValueError) before the payload is opened.
        """
        self._assert_single_dp("update weights from tensor")
        if load_format not in (None, "direct", FLATTENED_BUCKET):
            raise ValueError(f"Unknown load_format={load_format}")
        with self._control:
            self._require_session("update_weights_from_tensor")
            if len(payloads) != self.tp_size:
                raise ValueError(
                    f"the reference engine has {self.tp_size} TP rank(s); got {len(payloads)} serialized_named_tensors"
                )
            named_tensors = deserialize_payload(payloads[self.tp_rank], load_format)
            self._check_sender(shared_memory_owners(named_tensors))
            self._shared_buffers.hold(named_tensors)
            self._load(named_tensors, version, flush)

    def _check_sender(self, owners: set[int]) -> None:
        """Within a session, all of TP rank 0's tensors come from one process: the trainer rank on its device
        (a CPU stand-in for SGLang's rank opening handles of its own GPU only). Logged when it changes."""
        if len(owners) > 1 or (owners and self._sender not in (None, *owners)):
            previous = "" if self._sender is None else f" (this session's earlier buckets: process {self._sender})"
            raise WeightUpdateRefused(
                f"TP rank 0's payload holds memory of processes {sorted(owners)}{previous}: each engine rank is "
                "fed by the one trainer rank placed on its device"
            )
        if owners and self._sender is None:
            self._sender = owners.pop()
            if self._sender != self._last_sender:
                logger.info("weights for TP rank 0 come from process %d", self._sender)
                self._last_sender = self._sender

    def init_group(self, request: InitWeightsUpdateGroupRequest) -> None:
        """Join the trainer's broadcast group as rank ``rank_offset + tp_rank`` (SGLang's rank of a TP rank);
        blocks other weight requests until it forms."""
        self._assert_single_dp("update weights from distributed")
        with self._control:
            self._init_group(request)

    def _init_group(self, request: InitWeightsUpdateGroupRequest) -> None:
        if request.group_name in self._groups:
            raise WeightUpdateRefused(f"weight update group {request.group_name!r} already exists; destroy it first")
        logger.info(
            "joining weight update group %r at %s:%d as rank %d of %d (%s)",
            request.group_name,
            request.master_address,
            request.master_port,
            request.rank_offset + self.tp_rank,
            request.world_size,
            request.backend,
        )
        self._groups[request.group_name] = create_weight_group(
            request.master_address,
            request.master_port,
            request.rank_offset + self.tp_rank,
            request.world_size,
            request.group_name,
            request.backend,
        )

    def destroy_group(self, group_name: str) -> None:
        """Destroy a weight update group (``destroy_process_group``, as SGLang)."""
        self._assert_single_dp("destroy parameter update group")
        with self._control:
            group = self._groups.pop(group_name, None)
            if group is None:
                raise WeightUpdateRefused("The group to be destroyed does not exist.")
            destroy_weight_group(group)

    def update_from_distributed(self, request: UpdateWeightsFromDistributedRequest) -> None:
        """Receive each named tensor by broadcast from the trainer (rank 0), or with ``load_format="flattened_bucket"``
        all of them in one broadcast (SGLang's layout and checks: :func:`empty_bucket`), then load them; inside a
        session."""
        self._assert_single_dp("update weights from distributed")
        with self._control:
            self._require_session("update_weights_from_distributed")
            group = self._groups.get(request.group_name)
            if group is None:
                raise WeightUpdateRefused(
                    f"Group {request.group_name} not in {sorted(self._groups)}. "
                    "Please call `init_weights_update_group` first."
                )
            if not len(request.names) == len(request.dtypes) == len(request.shapes):
                raise ValueError("names, dtypes and shapes must have the same length")
            dtypes = [getattr(torch, dtype) for dtype in request.dtypes]
            if request.load_format == FLATTENED_BUCKET:
                flat, received = empty_bucket(request.names, dtypes, request.shapes, self.device)
                broadcast_from_trainer(group, flat)
            else:
                received = []
                for name, dtype, shape in zip(request.names, dtypes, request.shapes, strict=True):
                    tensor = torch.empty(shape, dtype=dtype, device=self.device)
                    broadcast_from_trainer(group, tensor)
                    received.append((name, tensor))
            self._load(received, request.weight_version, request.flush_cache)

    def update_from_disk(self, model_path: str, version: str | None, flush: bool = False) -> None:
        """Reload every weight from the ``*.safetensors`` files in ``model_path`` (all weights must be there)."""
        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in {model_path}")
        named = [item for file in files for item in load_file(file).items()]
        total = sum(p.numel() for p in self.params.values())
        written = sum(t.numel() for name, t in named if self.fp8 is None or not name.endswith(SCALE_SUFFIX))
        if written != total:
            raise ValueError(f"{model_path} holds {written} weight elements; the model has {total}")
        with self._control:
            self._load(named, version, flush)

    def update_weight_version(self, request: UpdateWeightVersionRequest) -> dict[str, Any]:
        """Report ``request.new_version`` from now on, weights unchanged; with ``abort_all_requests`` (SGLang's
        default) every request in flight is aborted first. SGLang's answer (``http_server.py:1527-1555``)."""
        if request.abort_all_requests:
            self.abort("", abort_all=True)
        with self._state:
            self.weight_version = request.new_version
        version = request.new_version
        return {"success": True, "message": f"Weight version updated to {version}", "new_version": version}

    def _check_lora_enabled(self) -> None:
        """SGLang's first checks of a LoRA load or unload: enabled, then ``dp_size == 1`` (an assertion: HTTP 500;
        ``tokenizer_control_mixin.py:667-674``)."""
        self.lora.check_enabled()
        self._assert_single_dp("dynamic lora loading")

    def load_lora_from_tensors(self, request: LoadLoRAAdapterFromTensorsRequest) -> dict[str, Any]:
        """Register an adapter from payload ``tp_rank`` of ``serialized_named_tensors`` (copied); SGLang's
        ``LoRAUpdateOutput``. The payload is SGLang's (``srt/managers/tp_worker.py:217-230``): a
        ``flattened_bucket``, or else a pickled DICT of name -> tensor (a list of pairs fails as in SGLang, whose
        loader calls ``tensors.items()``). Refusals (:mod:`lora_adapters`) raise LoRAUpdateFailed; ValueError for a
        payload count other than the TP size or checksums (which the reference engine does not verify)."""
        self._check_lora_enabled()
        if request.added_tokens_config:
            raise self.lora.refusal(
                f"Failed to load {request.lora_name} because LoRA serving currently doesn't support adapters that "
                "add tokens to the vocabulary"
            )
        if request.expected_checksums is not None:
            raise ValueError("the reference engine does not verify expected_checksums; send None")
        if request.load_format not in (None, FLATTENED_BUCKET):
            raise ValueError(f"Unknown load_format={request.load_format}")
        if len(request.serialized_named_tensors) != self.tp_size:
            raise ValueError(
                f"the reference engine has {self.tp_size} TP rank(s); "
                f"got {len(request.serialized_named_tensors)} serialized_named_tensors"
            )
        payload = request.serialized_named_tensors[self.tp_rank]
        if request.load_format == FLATTENED_BUCKET:
            named = deserialize_payload(payload, request.load_format)
        else:
            tensors = deserialize_tensors(payload)
            if not isinstance(tensors, dict):  # SGLang: AttributeError in initialize_weights_from_tensors, answered
                raise self.lora.refusal(f"'{type(tensors).__name__}' object has no attribute 'items'")
            named = list(tensors.items())
        self.lora.load(request.lora_name, TENSOR_PATH, request.config_dict, named)
        return self.lora.result().to_json()

    def load_lora_from_path(self, request: LoadLoRAAdapterRequest) -> dict[str, Any]:
        """Register an adapter from a PEFT directory; SGLang's ``LoRAUpdateOutput`` (refusals: LoRAUpdateFailed)."""
        self._check_lora_enabled()
        try:
            config, named = read_peft_dir(request.lora_path)
        except ValueError as error:
            raise self.lora.refusal(str(error)) from error
        self.lora.load(request.lora_name, request.lora_path, config, named)
        return self.lora.result().to_json()

    def unload_lora(self, name: str) -> dict[str, Any]:
        """Forget adapter ``name`` (requests holding it finish with it); SGLang's ``LoRAUpdateOutput``."""
        self._check_lora_enabled()
        self.lora.unload(name)
        return self.lora.result().to_json()

    def weights_by_name(self, name: str, truncate_size: int) -> list[Any]:
        """The weight ``name`` (Hub naming) as nested lists, first ``truncate_size`` rows (exact fp32 values)."""
        with self._model_lock:
            held = None if self.fp8 is None else self.fp8.lookup(name)
            return (resolve_weight(self.params, name) if held is None else held)[:truncate_size].float().tolist()

    def check_weights(self, request: CheckWeightsRequest) -> dict[str, Any]:
        """SGLang's ``/weights_checker`` answer (:mod:`~megatron_rl.engines.reference.weight_checker`), between
        decode steps as SGLang's scheduler runs it; WeightCheckFailed (HTTP 400) with SGLang's message."""
        with self._model_lock:
            return self.weight_checker.handle(request)
