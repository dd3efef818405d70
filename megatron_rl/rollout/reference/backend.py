"""State and operations of the reference engine (the HTTP layer is ``reference_server``).

Concurrency: any number of handler threads; one model lock serialises
forward passes and weight writes, so a weight update waits for the running
request to finish or pause. A paused request gives the model lock up at its
next token and holds its KV cache (``retract`` is treated as ``in_place``:
after a weight update a held request continues on its old cache; RL syncs
between steps, with nothing in flight). Aborts are checked before every
forward step. Memory release (CPU or GPU): ``weights`` frees every parameter's
storage (generation is refused until resumed and updated: resumed weights are
zeros, as with SGLang's memory saver without CPU backup), ``kv_cache`` is
bookkeeping only (the cache is per request).
"""

from __future__ import annotations

import logging
import threading
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
from megatron_rl.rollout.reference.weights import load_named_tensors, resolve_weight
from megatron_rl.weight_sync.tensor_serialization import deserialize_named_tensors
from megatron_rl.weight_sync.weight_group import broadcast_from_trainer, create_weight_group

logger = logging.getLogger(__name__)


class EngineStateError(RuntimeError):
    """The request cannot run in the engine's current state (answered with HTTP 400)."""


class ReferenceBackend:
    """One model, its weight version, pause/abort state and weight-update groups."""

    def __init__(self, model: torch.nn.Module, *, seed: int = 0) -> None:
        self.model = model.eval()
        self.params = dict(model.named_parameters())
        self.device = next(model.parameters()).device
        self.recorder = RouterRecorder(model)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.weight_version = "default"
        self._model_lock = threading.Lock()
        self._state = threading.Condition()
        self._paused = False
        self._abort_epoch = 0
        self._aborted_rids: set[str] = set()
        self._in_flight = 0
        self._released: set[str] = set()
        self._shapes: dict[str, torch.Size] = {}
        self._groups: dict[str, Any] = {}

    def generate(self, request: GenerateRequest) -> dict | list[dict]:
        """SGLang ``/generate`` answer: one dict per sample (a list when n > 1)."""
        if request.stream:
            raise EngineStateError("the reference engine does not stream; send stream=false")
        if "weights" in self._released:
            raise EngineStateError("weights are released; call /resume_memory_occupation and update weights first")
        rid = request.rid or f"ref-{id(request)}"
        epoch = self._abort_epoch

        sample_rids = {rid} | {f"{rid}_{i}" for i in range(request.sampling_params.n)}

        def stopped() -> bool:
            return self._abort_epoch != epoch or not sample_rids.isdisjoint(self._aborted_rids)

        def checkpoint() -> None:  # runs with the model lock held; gives it up while paused
            while True:
                with self._state:
                    if stopped():
                        raise GenerationAborted(f"request {rid} aborted")
                    if not self._paused:
                        return
                self._model_lock.release()
                with self._state:
                    self._state.wait_for(lambda: not self._paused or stopped())
                self._model_lock.acquire()

        with self._state:
            self._in_flight += 1
        try:
            with self._model_lock:
                samples = generate_samples(self.model, request, self.recorder, checkpoint, self.generator)
                version = self.weight_version
        finally:
            with self._state:
                self._in_flight -= 1
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
        """Abort one request id (also one that has not arrived yet) or every running request."""
        with self._state:
            if abort_all:
                self._abort_epoch += 1
            else:
                self._aborted_rids.add(rid)
            self._state.notify_all()

    def pause(self, mode: str) -> None:
        """Hold generation at the next token; ``abort`` also aborts every running request."""
        with self._state:
            self._paused = True
            if mode == "abort":
                self._abort_epoch += 1
            self._state.notify_all()

    def resume_generation(self) -> None:
        """Let held and new requests run again."""
        with self._state:
            self._paused = False
            self._state.notify_all()

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

    def _load(self, named_tensors: list[tuple[str, torch.Tensor]], version: str | None) -> None:
        if "weights" in self._released:
            raise EngineStateError("weights are released; call /resume_memory_occupation before updating them")
        with self._model_lock:
            load_named_tensors(self.params, named_tensors)
            if version is not None:
                self.weight_version = version

    def update_from_tensor(self, payloads: list[str], version: str | None) -> None:
        """Load one serialized bucket (this engine has one rank, so exactly one payload)."""
        if len(payloads) != 1:
            raise ValueError(f"the reference engine has 1 TP rank; got {len(payloads)} serialized_named_tensors")
        self._load(deserialize_named_tensors(payloads[0]), version)

    def init_group(self, request: InitWeightsUpdateGroupRequest) -> None:
        """Join the trainer's broadcast group as rank ``rank_offset``; logs the group's address and this rank."""
        if request.group_name in self._groups:
            raise EngineStateError(f"weight update group {request.group_name!r} already exists; destroy it first")
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
        """Forget a weight update group (its store closes with it)."""
        if self._groups.pop(group_name, None) is None:
            raise EngineStateError(f"no weight update group named {group_name!r}")

    def update_from_distributed(self, request: UpdateWeightsFromDistributedRequest) -> None:
        """Receive each named tensor by broadcast from the trainer (rank 0), then load them all."""
        group = self._groups.get(request.group_name)
        if group is None:
            raise EngineStateError(f"no weight update group {request.group_name!r}; call /init_weights_update_group")
        if not len(request.names) == len(request.dtypes) == len(request.shapes):
            raise ValueError("names, dtypes and shapes must have the same length")
        received = []
        for name, dtype, shape in zip(request.names, request.dtypes, request.shapes, strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            broadcast_from_trainer(group, tensor)
            received.append((name, tensor))
        self._load(received, request.weight_version)

    def update_from_disk(self, model_path: str, version: str | None) -> None:
        """Reload every weight from the ``*.safetensors`` files in ``model_path`` (all weights must be there)."""
        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in {model_path}")
        named = [item for file in files for item in load_file(file).items()]
        total = sum(p.numel() for p in self.params.values())
        written = sum(t.numel() for _, t in named)
        if written != total:
            raise ValueError(f"{model_path} holds {written} weight elements; the model has {total}")
        self._load(named, version)

    def weights_by_name(self, name: str, truncate_size: int) -> list:
        """The weight ``name`` (Hub naming) as nested lists, first ``truncate_size`` rows (exact fp32 values)."""
        with self._model_lock:
            return resolve_weight(self.params, name)[:truncate_size].float().tolist()
