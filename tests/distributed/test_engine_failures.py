"""Engine failures surface as clear errors within their timeouts, never as hangs (real subprocesses)."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from megatron_rl.engines import (
    EngineRequestError,
    EngineStartupError,
    EngineTimeoutError,
    EngineUnavailableError,
    GenerateRequest,
    HttpEngine,
    ReferenceEngine,
    SamplingParams,
)
from megatron_rl.engines.server_process import ServerProcess
from tests.distributed_utils import free_port
from tests.tiny_checkpoints import save_tiny_moe

pytestmark = pytest.mark.distributed

ALWAYS_500 = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def _fail(self):
        body = b'{"error": {"message": "scheduler crashed", "code": 500}}'
        self.send_response(500); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    do_GET = do_POST = _fail
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _request(max_new_tokens: int = 4) -> GenerateRequest:
    return GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=max_new_tokens))


@pytest.fixture
def reference(tmp_path):
    engine = ReferenceEngine("ref", save_tiny_moe(tmp_path / "moe"), free_port(), log_dir=tmp_path)
    engine.start()
    engine.wait_healthy(120)
    yield engine
    engine.shutdown()


def test_engine_that_exits_at_start_reports_its_log(tmp_path):
    engine = ReferenceEngine("broken", tmp_path / "no-such-model", free_port(), log_dir=tmp_path)
    engine.start()
    with pytest.raises(EngineStartupError, match="(?s)exited before becoming healthy.*no-such-model: no config.json"):
        engine.wait_healthy(120)


def test_log_tail_is_the_last_lines_within_the_character_limit(tmp_path):
    process = ServerProcess([sys.executable, "-c", "for i in range(100): print(f'line {i}')"], tmp_path / "lines.log")
    process.start()
    assert process.wait_for_exit(30) == 0
    assert process.log_tail().splitlines() == [f"line {i}" for i in range(60, 100)]
    assert process.log_tail(lines=2, max_chars=9) == "8\nline 99"


def test_engine_that_never_listens_times_out(tmp_path):
    process = ServerProcess([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "silent.log")
    engine = HttpEngine("silent", "127.0.0.1", free_port(), process=process)
    engine.start()
    start = time.monotonic()
    with pytest.raises(EngineStartupError, match="not healthy .* after 2 s"):
        engine.wait_healthy(2)
    assert time.monotonic() - start < 10
    engine.shutdown()
    assert process.exit_code is not None


def test_port_nobody_listens_on_is_unavailable():
    engine = HttpEngine("nobody", "127.0.0.1", free_port())
    with pytest.raises(EngineUnavailableError, match=r"nobody: /generate failed at http://127\.0\.0\.1:\d+/generate"):
        engine.generate(_request(), timeout_s=5)


def test_server_answering_500_raises_with_status_and_body(tmp_path):
    port = free_port()
    engine = HttpEngine(
        "failing",
        "127.0.0.1",
        port,
        process=ServerProcess([sys.executable, "-c", ALWAYS_500, str(port)], tmp_path / "f.log"),
    )
    engine.start()
    try:
        with pytest.raises(EngineStartupError, match="HTTP 500"):
            engine.wait_healthy(3)
        with pytest.raises(EngineRequestError, match="answered HTTP 500 at http://.*scheduler crashed") as error:
            engine.generate(_request(), timeout_s=5)
        assert error.value.status == 500
    finally:
        engine.shutdown()


def test_bad_request_is_refused_naming_the_field(reference):
    with pytest.raises(EngineRequestError, match="unknown field.*'temprature'") as error:
        reference.request("/generate", {"input_ids": [1], "sampling_params": {"temprature": 0.5}})
    assert error.value.status == 400


def test_request_timeout_and_engine_killed_mid_request(reference):
    reference.pause_generation("in_place")  # requests now wait inside the engine
    with pytest.raises(EngineTimeoutError, match="ref: /generate got no answer within 1 s"):
        reference.generate(_request(), timeout_s=1)

    errors: list[Exception | None] = []
    waiting = threading.Thread(target=lambda: errors.append(_capture(reference)))
    waiting.start()
    time.sleep(0.5)
    start = time.monotonic()
    reference.process.stop()
    waiting.join(timeout=10)
    assert not waiting.is_alive() and time.monotonic() - start < 10
    assert isinstance(errors[0], EngineUnavailableError), errors
    assert "engine process exited" in str(errors[0])


def _capture(engine) -> Exception | None:
    try:
        engine.generate(_request(), timeout_s=60)
    except Exception as error:  # noqa: BLE001 - the test inspects it
        return error
    return None
