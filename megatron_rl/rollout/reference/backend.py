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

Concurrency: any number of handler threads; one model lock serialises forward
passes and weight writes, so a weight update waits for the running request to
finish or pause. A paused request gives the model lock up at its next token;
``in_place`` keeps its KV cache, ``retract`` lets a flush drop it. Aborts are
checked before every forward step. Memory release (CPU or GPU): ``weights``
frees every parameter's storage (generation is refused until resumed and
updated: resumed weights are zeros, as with SGLang's memory saver without CPU
backup), ``kv_cache`` is bookkeeping only (the cache is per request).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from megatron_rl.rollout.protocol import (
    MEMORY_TAGS,
    GenerateRequest,
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDistributedRequest,
    encode_routed_experts,
)
from megatron_rl.rollout.reference.generator import GenerationAborted, RouterRecorder, generate_samples
from megatron_rl.rollout.reference.shared_buffers import SharedBufferMappings
from megatron_rl.rollout.reference.weights import load_named_tensors, resolve_weight
from megatron_rl.weight_sync.tensor_serialization import deserialize_named_tensors
from megatron_rl.weight_sync.weight_group import (
    WeightGroup,
    broadcast_from_trainer,
    create_weight_group,
    destroy_weight_group,
)

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


class ReferenceBackend:
    """One model, its weight version, pause/abort state, weight-update session and groups.

    ``dp_size``: the data-parallel size the engine claims (SGLang's ``--dp-size``); above 1
    every weight update fails as SGLang's does.
    """

    def __init__(self, model: torch.nn.Module, *, seed: int = 0, dp_size: int = 1) -> None:
        self.model = model.eval()
        self.params = dict(model.named_parameters())
        self.device = next(model.parameters()).device
        self.recorder = RouterRecorder(model)
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
        self._aborted_rids: set[str] = set()
        self._active_rids: set[str] = set()
        self._in_flight = 0
        self._released: set[str] = set()
        self._shapes: dict[str, torch.Size] = {}
        self._groups: dict[str, WeightGroup] = {}
        self._shared_buffers = SharedBufferMappings()

    def generate(self, request: GenerateRequest) -> dict | list[dict]:
        """SGLang ``/generate`` answer: one dict per sample (a list when n > 1)."""
        if request.stream:
            raise EngineStateError("the reference engine does not stream; send stream=false")
        if "weights" in self._released:
            raise EngineStateError("weights are released; call /resume_memory_occupation and update weights first")
        rid = request.rid or f"ref-{id(request)}"
        epoch = self._abort_epoch

        n = request.sampling_params.n
        sample_rids = {rid} if n == 1 else {f"{rid}_{i}" for i in range(n)}  # the rids SGLang registers

        def stopped() -> bool:
            return self._abort_epoch != epoch or not sample_rids.isdisjoint(self._aborted_rids)

        cache_epoch = [self._cache_epoch]

        def checkpoint() -> bool:  # runs with the model lock held; gives it up while paused
            while True:
                with self._state:
                    if stopped():
                        raise GenerationAborted(f"request {rid} aborted")
                    if not self._paused:
                        flushed, cache_epoch[0] = cache_epoch[0] != self._cache_epoch, self._cache_epoch
                        return flushed
                self._model_lock.release()
                with self._state:
                    self._state.wait_for(lambda: not self._paused or stopped())
                self._model_lock.acquire()

        with self._state:
            self._in_flight += 1
            self._active_rids |= sample_rids
        try:
            with self._model_lock:
                with self._state:
                    self._decoding += 1
                    cache_epoch[0] = self._cache_epoch
                try:
                    samples = generate_samples(self.model, request, self.recorder, checkpoint, self.generator)
                finally:
                    with self._state:
                        self._decoding -= 1
                version = self.weight_version
        finally:
            with self._state:
                self._in_flight -= 1
                self._active_rids -= sample_rids
                self._aborted_rids -= sample_rids
        multiple = request.sampling_params.n > 1
        answers = [
            self._sample_json(rid, i, s, len(request.input_ids), version, multiple) for i, s in enumerate(samples)
        ]
        return answers if multiple else answers[0]

    @staticmethod
    def _sample_json(rid: str, index: int, sample, prompt_tokens: int, version: str, multiple: bool = False) -> dict:
        """One sample's SGLang JSON; with n > 1 its id is ``{rid}_{index}`` as SGLang names expanded samples."""
        meta: dict[str, Any] = {
            "id": f"{rid}_{index}" if index or multiple else rid,
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
        that arrives later); a request with n > 1 registers ``{rid}_{i}`` only, so its bare rid is
        ignored. Unlike SGLang, aborting one sample's rid aborts the whole request (its samples are
        decoded together); our client aborts all of a request's samples at once anyway.
        """
        with self._state:
            if abort_all:
                self._abort_epoch += 1
            elif rid in self._active_rids:
                self._aborted_rids.add(rid)
            self._state.notify_all()

    def pause(self, mode: str) -> dict:
        """Hold generation at the next token; ``abort`` also aborts every running request (SGLang's answer)."""
        with self._state:
            self._paused = True
            self._pause_mode = mode
            if mode == "abort":
                self._abort_epoch += 1
            self._state.notify_all()
        return {"message": "Generation paused successfully.", "status": "ok"}

    def resume_generation(self) -> dict:
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
        with self._model_lock, self._state:  # every decoding request is now held at a checkpoint or gone
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
        with self._model_lock:
            load_named_tensors(self.params, named_tensors)
            if version is not None:
                self.weight_version = version
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

    def end_weight_update(self) -> None:
        """Close the session (plain PyTorch weights need no post-processing); refused when none is open."""
        with self._control:
            if not self._session:
                raise WeightUpdateRefused("no weight-update session is open; call begin_weight_update() first")
            self._session = False
            self._shared_buffers.end_sync()

    def update_from_tensor(self, payloads: list[str], version: str | None, flush: bool = False) -> None:
        """Load one serialized bucket (this engine has one rank, so exactly one payload); inside a session."""
        self._assert_single_dp("update weights from tensor")
        with self._control:
            self._require_session("update_weights_from_tensor")
            if len(payloads) != 1:
                raise ValueError(f"the reference engine has 1 TP rank; got {len(payloads)} serialized_named_tensors")
            named_tensors = deserialize_named_tensors(payloads[0])
            self._shared_buffers.hold(named_tensors)
            self._load(named_tensors, version, flush)

    def init_group(self, request: InitWeightsUpdateGroupRequest) -> None:
        """Join the trainer's broadcast group as rank ``rank_offset``; blocks other weight requests until it forms."""
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
            request.rank_offset,
            request.world_size,
            request.backend,
        )
        self._groups[request.group_name] = create_weight_group(
            request.master_address,
            request.master_port,
            request.rank_offset,
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
        """Receive each named tensor by broadcast from the trainer (rank 0), then load them all; inside a session."""
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
            received = []
            for name, dtype, shape in zip(request.names, request.dtypes, request.shapes, strict=True):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
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
        written = sum(t.numel() for _, t in named)
        if written != total:
            raise ValueError(f"{model_path} holds {written} weight elements; the model has {total}")
        with self._control:
            self._load(named, version, flush)

    def weights_by_name(self, name: str, truncate_size: int) -> list:
        """The weight ``name`` (Hub naming) as nested lists, first ``truncate_size`` rows (exact fp32 values)."""
        with self._model_lock:
            return resolve_weight(self.params, name)[:truncate_size].float().tolist()
