"""Test engines typed as :class:`RolloutEngine`, so code that takes engines can be handed them and type-checked.

:class:`PartialEngine`: a stand-in that implements only the calls a test expects (weight updates, say); any
other call raises NotImplementedError naming the stand-in and the call. :class:`DelegatingEngine`: every call
goes to the engine it wraps; subclasses override the calls they watch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

from megatron_rl.engines.engine import RolloutEngine
from megatron_rl.engines.protocol import (
    GenerateRequest,
    GenerateResult,
    InitWeightsUpdateGroupRequest,
    PauseMode,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
)


class PartialEngine(RolloutEngine):
    """A RolloutEngine whose calls all fail until a subclass implements them."""

    name = "partial"

    def _unexpected(self, call: str) -> NoReturn:
        raise NotImplementedError(f"the test engine {type(self).__name__} does not expect {call}")

    def start(self) -> None:
        self._unexpected("start")

    def wait_healthy(self, timeout_s: float) -> None:
        self._unexpected("wait_healthy")

    def generate(self, request: GenerateRequest, *, timeout_s: float | None = None) -> list[GenerateResult]:
        self._unexpected("generate")

    def abort(self, rid: str | None = None) -> None:
        self._unexpected("abort")

    def pause_generation(self, mode: PauseMode = "retract") -> None:
        self._unexpected("pause_generation")

    def continue_generation(self) -> None:
        self._unexpected("continue_generation")

    def flush_cache(self) -> None:
        self._unexpected("flush_cache")

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        self._unexpected("release_memory")

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        self._unexpected("resume_memory")

    def begin_weight_update(self) -> None:
        self._unexpected("begin_weight_update")

    def end_weight_update(self) -> None:
        self._unexpected("end_weight_update")

    def update_weights_from_tensor(self, request: UpdateWeightsFromTensorRequest) -> None:
        self._unexpected("update_weights_from_tensor")

    def init_weights_update_group(self, request: InitWeightsUpdateGroupRequest) -> None:
        self._unexpected("init_weights_update_group")

    def destroy_weights_update_group(self, group_name: str) -> None:
        self._unexpected("destroy_weights_update_group")

    def update_weights_from_distributed(self, request: UpdateWeightsFromDistributedRequest) -> None:
        self._unexpected("update_weights_from_distributed")

    def update_weights_from_disk(self, request: UpdateWeightsFromDiskRequest) -> None:
        self._unexpected("update_weights_from_disk")

    def check_weights(
        self, action: str, *, allow_quant_error: bool = False, skip_tensor_list: list[str] | None = None
    ) -> dict:
        self._unexpected("check_weights")

    def shutdown(self) -> None:
        self._unexpected("shutdown")


class DelegatingEngine(RolloutEngine):
    """``engine``'s calls, made through this object; attributes beyond RolloutEngine's are ``engine``'s too."""

    def __init__(self, engine: RolloutEngine) -> None:
        self._engine = engine
        self.name = engine.name

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def start(self) -> None:
        self._engine.start()

    def wait_healthy(self, timeout_s: float) -> None:
        self._engine.wait_healthy(timeout_s)

    def generate(self, request: GenerateRequest, *, timeout_s: float | None = None) -> list[GenerateResult]:
        return self._engine.generate(request, timeout_s=timeout_s)

    def abort(self, rid: str | None = None) -> None:
        self._engine.abort(rid)

    def pause_generation(self, mode: PauseMode = "retract") -> None:
        self._engine.pause_generation(mode)

    def continue_generation(self) -> None:
        self._engine.continue_generation()

    def flush_cache(self) -> None:
        self._engine.flush_cache()

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        self._engine.release_memory(tags)

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        self._engine.resume_memory(tags)

    def begin_weight_update(self) -> None:
        self._engine.begin_weight_update()

    def end_weight_update(self) -> None:
        self._engine.end_weight_update()

    def update_weights_from_tensor(self, request: UpdateWeightsFromTensorRequest) -> None:
        self._engine.update_weights_from_tensor(request)

    def init_weights_update_group(self, request: InitWeightsUpdateGroupRequest) -> None:
        self._engine.init_weights_update_group(request)

    def destroy_weights_update_group(self, group_name: str) -> None:
        self._engine.destroy_weights_update_group(group_name)

    def update_weights_from_distributed(self, request: UpdateWeightsFromDistributedRequest) -> None:
        self._engine.update_weights_from_distributed(request)

    def update_weights_from_disk(self, request: UpdateWeightsFromDiskRequest) -> None:
        self._engine.update_weights_from_disk(request)

    def check_weights(
        self, action: str, *, allow_quant_error: bool = False, skip_tensor_list: list[str] | None = None
    ) -> dict:
        return self._engine.check_weights(
            action, allow_quant_error=allow_quant_error, skip_tensor_list=skip_tensor_list
        )

    def shutdown(self) -> None:
        self._engine.shutdown()
