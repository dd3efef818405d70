"""The rollout engine interface and its errors.

An engine is one inference server (SGLang in production, the reference engine
in tests and tiny runs) that owns some accelerators, generates from token ids
and accepts new weights. Every call either returns within its timeout or raises
an :class:`EngineError` subclass naming the engine, the endpoint and the cause:
a dead process, a refused connection, a timeout or an error status never turn
into a hang.

Weight-update calls carry ``weight_version``; generation results report the
version the engine held (``GenerateResult.weight_version``).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

from megatron_rl.engines.protocol import (
    GenerateRequest,
    GenerateResult,
    InitWeightsUpdateGroupRequest,
    PauseMode,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
)


class EngineError(RuntimeError):
    """Base of every engine failure; the message names the engine and what to check."""


class EngineStartupError(EngineError):
    """The engine process exited, or did not become healthy within its start-up timeout."""


class EngineUnavailableError(EngineError):
    """The engine could not be reached or dropped the connection (process dead, wrong port)."""


class EngineTimeoutError(EngineError):
    """A request got no answer within its timeout."""


class EngineResponseError(EngineError):
    """The engine answered, but not in the protocol's shape (malformed JSON, fields missing or of another type)."""


class EngineRequestError(EngineError):
    """The engine answered with an error status; ``status`` and ``body`` hold its answer."""

    def __init__(self, message: str, *, status: int, body: str) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class RolloutEngine(abc.ABC):
    """One inference engine. Methods block; call them from threads for concurrency (they are thread-safe)."""

    name: str

    @abc.abstractmethod
    def start(self) -> None:
        """Launch the engine process (returns once it is started, not healthy)."""

    @abc.abstractmethod
    def wait_healthy(self, timeout_s: float) -> None:
        """Block until the engine answers ``/health``; EngineStartupError on exit or timeout."""

    @abc.abstractmethod
    def generate(self, request: GenerateRequest, *, timeout_s: float | None = None) -> list[GenerateResult]:
        """Generate ``request.sampling_params.n`` samples of one prompt; one result per sample."""

    @abc.abstractmethod
    def abort(self, rid: str | None = None) -> None:
        """Abort the request ``rid`` (all requests when None); its samples come back with finish ``abort``."""

    @abc.abstractmethod
    def pause_generation(self, mode: PauseMode = "retract") -> None:
        """Stop scheduling generation (``abort`` drops in-flight requests, ``retract``/``in_place`` hold them)."""

    @abc.abstractmethod
    def continue_generation(self) -> None:
        """Resume generation after :meth:`pause_generation`."""

    @abc.abstractmethod
    def flush_cache(self) -> None:
        """Drop the prefix cache (stale after a weight update); refused while requests run, unless paused
        with ``retract`` (SGLang answers 400: EngineRequestError)."""

    @abc.abstractmethod
    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free accelerator memory of ``tags`` (``weights``, ``kv_cache``, ``cuda_graph``; None: all)."""

    @abc.abstractmethod
    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate what :meth:`release_memory` freed (released weights must be updated before use)."""

    @abc.abstractmethod
    def begin_weight_update(self) -> None:
        """Open the engine's weight-update session (SGLang 0.5.23 refuses tensor/distributed updates outside one)."""

    @abc.abstractmethod
    def end_weight_update(self) -> None:
        """Close the session; the engine post-processes the new weights here (SGLang: block FP8 scales
        re-quantised to UE8M0 on Blackwell only; on Hopper FP8 weights and scales stay as sent)."""

    @abc.abstractmethod
    def update_weights_from_tensor(self, request: UpdateWeightsFromTensorRequest) -> None:
        """Load a bucket of named tensors passed as IPC handles (colocated engines; inside a session)."""

    @abc.abstractmethod
    def init_weights_update_group(self, request: InitWeightsUpdateGroupRequest) -> None:
        """Join a broadcast group whose rank 0 is a trainer rank (blocks until every member joined)."""

    @abc.abstractmethod
    def destroy_weights_update_group(self, group_name: str) -> None:
        """Leave and destroy a group created by :meth:`init_weights_update_group`."""

    @abc.abstractmethod
    def update_weights_from_distributed(self, request: UpdateWeightsFromDistributedRequest) -> None:
        """Receive ``request.names`` by broadcast from rank 0 of the group, in order (inside a session)."""

    @abc.abstractmethod
    def update_weights_from_disk(self, request: UpdateWeightsFromDiskRequest) -> None:
        """Reload all weights from a Hugging Face directory."""

    @abc.abstractmethod
    def check_weights(
        self, action: str, *, allow_quant_error: bool = False, skip_tensor_list: list[str] | None = None
    ) -> dict[str, Any]:
        """SGLang's ``/weights_checker`` ``action`` (``snapshot``, ``reset_tensors``, ``compare``, ``checksum``):
        its answer body; EngineRequestError carrying SGLang's message when the check fails (a compare that
        found differences names each differing tensor on a line of its own, ``name=...``)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the engine process; safe to call twice."""
