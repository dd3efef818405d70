"""The real SGLang 0.5.23 server's control endpoints, its API key and what its CPU path cannot do."""

from __future__ import annotations

import os

import pytest

from megatron_rl.config.sglang_pin import CONFIG_FILE_NAME
from megatron_rl.engines.engine import EngineRequestError, EngineStartupError, EngineUnavailableError
from megatron_rl.engines.protocol import FLUSH_CACHE_OK, GenerateRequest, SamplingParams
from tests.api_key_cases import API_KEY, KEY_CASES, raw_request
from tests.sglang.conftest import start_sglang


def test_flush_cache_answers_the_same_plain_text_on_both_engines(sglang, reference):
    for engine in (sglang, reference):
        assert engine.request("/flush_cache", {}) == FLUSH_CACHE_OK


def test_health_and_health_generate_answer_on_both_engines(sglang, reference):
    for engine in (sglang, reference):
        assert engine.request("/health") is None
        engine.request("/health_generate")


def _port(engine) -> int:
    return int(engine.base_url.rsplit(":", 1)[1])


@pytest.mark.parametrize("case", KEY_CASES, ids=lambda c: f"{c[0]} {c[1]} {c[2]} {(c[3] or b'')[:9]!r}")
def test_the_reference_engine_answers_every_key_case_as_sglang_does(sglang, reference, case):
    """The real server behind its own --api-key middleware and ours: same status; the same 401 bytes."""
    theirs = raw_request(_port(sglang), *case)
    ours = raw_request(_port(reference), *case)
    assert ours[0] == theirs[0], (ours, theirs)
    if theirs[0] == 401:
        assert ours == theirs == (401, "application/json", b'{"error":"Unauthorized"}')


def test_the_key_reaches_sglang_through_a_file_that_is_gone_once_healthy(sglang):
    """Our launcher passes --config FILE, never the key on the command line; SGLang read it (401s above)."""
    assert API_KEY not in " ".join(sglang.process.command)
    config_flag = sglang.process.command.index("--config")
    assert sglang.process.command[config_flag + 1].endswith(CONFIG_FILE_NAME)
    assert not os.path.exists(sglang.process.command[config_flag + 1])
    assert API_KEY not in sglang.process.log_path.read_text()


def test_the_cpu_engine_loads_the_driver_stand_in_and_no_real_driver(sglang):
    """Our libcuda.so.1 is mapped into the server process; the environment names SGLang's CPU engine."""
    with open(f"/proc/{sglang.process.pid}/maps") as maps:
        drivers = {line.split()[-1] for line in maps if "libcuda.so" in line}
    assert drivers and all("libcuda-standin-" in path for path in drivers)
    assert sglang.process.env["SGLANG_USE_CPU_ENGINE"] == "1"


# Full tier: a server of its own to document the pinned SGLang on CPU (engines_hand_over_memory keeps runs off it).
@pytest.mark.full
def test_release_memory_kills_sglangs_cpu_scheduler_so_cpu_runs_never_ask(moe_dir, tmp_path):
    """SGLang 0.5.23's release synchronises a CUDA device (weight_updater.release_memory_occupation): on CPU its
    scheduler dies and the server exits. CPU runs therefore hand no memory over (resources.engines_hand_over_memory)."""
    engine = start_sglang(moe_dir, tmp_path, name="sglang-release", api_key=None)
    try:
        with pytest.raises((EngineUnavailableError, EngineRequestError)):
            engine.release_memory(["kv_cache"])
        assert engine.process is not None and engine.process.wait_for_exit(60) is not None
    finally:
        engine.shutdown()


# Full tier: a server of its own to document the pinned SGLang on CPU (validate refuses routing replay there).
@pytest.mark.full
def test_routed_experts_cannot_be_returned_by_sglang_on_cpu(moe_dir, tmp_path):
    """--enable-return-routed-experts allocates a CUDA-registered host buffer (state_capturer/base.py) and the
    CPU server does not start: validate refuses routing replay with SGLang on CPU."""
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.engines import SGLangEngine, SGLangPlacement
    from megatron_rl.parallel.local_launch import free_port
    from tests.sglang.conftest import CPU_ROLLOUT

    placement = SGLangPlacement(base_gpu_id=0, port=free_port(), nccl_port=free_port(), device="cpu")
    engine = SGLangEngine(
        "sglang-r3", RolloutConfig(**CPU_ROLLOUT), placement, moe_dir, log_dir=tmp_path, routing_replay=True
    )
    engine.start()
    try:
        with pytest.raises(EngineStartupError, match="cudart|CUDA|NVIDIA"):
            engine.wait_healthy(240)
    finally:
        engine.shutdown()


def test_a_generate_after_a_refused_request_still_serves(sglang):
    with pytest.raises(EngineRequestError):
        sglang.request("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}})
    (result,) = sglang.generate(GenerateRequest([1, 2], SamplingParams(max_new_tokens=2, temperature=0.0)))
    assert len(result.output_ids) == 2
