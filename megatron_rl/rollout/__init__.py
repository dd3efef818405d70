"""Rollout engines and the rollout manager.

Never imports Megatron, ``megatron_rl.models``/``actor``/``parallel`` or Ray.
``engine`` is the interface, ``protocol`` the SGLang HTTP subset shared by
the client (``http_engine``, ``sglang_engine``) and the reference engine
(the ``reference`` subpackage: its server, backend and generator), ``manager``
turns prompts into scored groups for a training step, through ``engine_pool`` (requests to the
engines), ``submissions`` (each window's requests), ``step_selection`` (which groups a step keeps)
and ``group_assembler`` (scored, shaped training groups). The reference engine
receives weights through ``weight_sync``'s torch-only wire modules.
"""

from megatron_rl.rollout.engine import (
    EngineError,
    EngineRequestError,
    EngineResponseError,
    EngineStartupError,
    EngineTimeoutError,
    EngineUnavailableError,
    RolloutEngine,
)
from megatron_rl.rollout.http_engine import HttpEngine
from megatron_rl.rollout.protocol import FinishReason, GenerateRequest, GenerateResult, SamplingParams
from megatron_rl.rollout.reference.engine import ReferenceEngine
from megatron_rl.rollout.sglang_engine import SGLangEngine, SGLangPlacement, build_sglang_command

__all__ = [
    "EngineError",
    "EngineRequestError",
    "EngineResponseError",
    "EngineStartupError",
    "EngineTimeoutError",
    "EngineUnavailableError",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "HttpEngine",
    "ReferenceEngine",
    "RolloutEngine",
    "SGLangEngine",
    "SGLangPlacement",
    "SamplingParams",
    "build_sglang_command",
]
