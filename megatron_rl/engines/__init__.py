"""The rollout engines: the clients the driver and trainer ranks talk to, and the engine processes themselves.

Never imports Megatron, Ray or anything of ``rollout``/``weight_sync``/``orchestration``/``actor``.
``engine`` is the interface, ``protocol`` the SGLang HTTP subset shared by the client
(``http_engine``, ``sglang_engine``, ``sglang_cpu`` with ``native/`` for SGLang on CPU) and the
reference engine (the ``reference`` subpackage: its server, backend and generator);
``access`` and ``server_process`` are what both kinds of engine process need. The reference
engine receives weights through the wire formats of :mod:`megatron_rl.wire`.
"""

from megatron_rl.engines.engine import (
    EngineError,
    EngineRequestError,
    EngineResponseError,
    EngineStartupError,
    EngineTimeoutError,
    EngineUnavailableError,
    RolloutEngine,
)
from megatron_rl.engines.http_engine import HttpEngine
from megatron_rl.engines.protocol import FinishReason, GenerateRequest, GenerateResult, SamplingParams
from megatron_rl.engines.reference.engine import ReferenceEngine
from megatron_rl.engines.sglang_engine import SGLangEngine, SGLangPlacement, build_sglang_command

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
